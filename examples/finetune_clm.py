"""Fine-tune a tiny causal LM with ZeRO through the Hugging Face Trainer.

    torchrun --nproc-per-node 2 examples/finetune_clm.py --zero_stage 2 --output_dir out/clm --max_steps 30

Every TrainingArguments flag works (``--bf16``, ``--gradient_accumulation_steps 4``,
``--save_steps 10``, ``--resume_from_checkpoint out/clm/checkpoint-10``, ...), plus the ZeRO flags
(``--zero_stage``, ``--zero_reduce_bucket_mb``, ``--zero_overlap_communication``,
``--zero_communication_dtype``, ``--zero_config JSON``) and ``--model_name_or_path DIR`` to start
from a local ``save_pretrained`` directory instead of a tiny GPT-2 built from a config.
The default corpus is ``hf_lowzero/data/zero_notes.txt`` (``--train_file`` for another), as UTF-8 bytes.
"""

import torch.distributed as dist
from transformers import HfArgumentParser

from hf_lowzero.recipes.clm import ClmArguments, finetune_clm
from hf_lowzero.trainer.arguments import LowZeroTrainingArguments


def main() -> None:
    parser = HfArgumentParser((ClmArguments, LowZeroTrainingArguments))
    model_args, args = parser.parse_args_into_dataclasses()
    trainer, metrics = finetune_clm(model_args, args, resume=args.resume_from_checkpoint)
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]  # none when logging_steps > steps
        logged = f"first loss={losses[0]:.4f} last loss={losses[-1]:.4f} " if losses else ""
        print(
            f"zero_stage={args.zero_stage} steps={trainer.state.global_step} {logged}"
            f"train_loss={metrics['train_loss']:.4f}"
        )
        print(f"model saved to {args.output_dir}")
    if dist.is_initialized():
        # Leave together: a rank that exits while its peer still holds gloo connections to it can
        # make the peer's transport thread abort the process ("terminate called ..."), after the work is done.
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
