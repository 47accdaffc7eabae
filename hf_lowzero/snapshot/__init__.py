"""Memory snapshots of the training state (torch only): a checkpoint whose storage is node memory.

``ShardStager`` copies this rank's shard out of the training loop's way ([Note: double buffer]);
``format`` turns the copy into a piece (JSON manifest and safetensors bytes, checksummed) and
pieces back into a checkpoint folder that ``load_checkpoint`` reads at any world size. Where the
pieces are kept (per-node holders on Ray) is ``hf_lowzero.ray.snapshots``.
"""

from hf_lowzero.snapshot.checkpoint_files import write_part, write_zero_metadata
from hf_lowzero.snapshot.checks import payload_error
from hf_lowzero.snapshot.format import MARKER_FILE, Piece, encode_piece
from hf_lowzero.snapshot.stager import ShardStager, Staged

__all__ = [
    "MARKER_FILE",
    "Piece",
    "ShardStager",
    "Staged",
    "encode_piece",
    "payload_error",
    "write_part",
    "write_zero_metadata",
]
