"""Memory snapshots of the training state (torch only): a checkpoint whose storage is node memory.

``ShardStager`` copies this rank's shard out of the training loop's way ([Note: double buffer]);
``format`` turns the copy into a piece (safetensors bytes, checksummed, and its details), whose
``Manifest`` and ``Frame`` are ``frame``'s (no torch: a holder reads them), and ``checkpoint_files``
turns pieces back into a checkpoint folder that ``load_checkpoint`` reads at any world size. What
a node keeps (``held``) and the records of the protocol between ranks and holders (``protocol``)
need no Ray; the holders themselves, per-node Ray actors, are ``hf_lowzero.ray.holder``.
"""

from typing import TYPE_CHECKING

from hf_lowzero.lazy_names import lazy_names

if TYPE_CHECKING:  # the exports, imported on first use (hf_lowzero/lazy_names.py)
    from hf_lowzero.snapshot.checkpoint_files import write_part, write_zero_metadata
    from hf_lowzero.snapshot.checks import payload_error
    from hf_lowzero.snapshot.format import MARKER_FILE, Piece, encode_piece
    from hf_lowzero.snapshot.frame import Frame, Manifest
    from hf_lowzero.snapshot.stager import ShardStager, Staged

__all__ = [
    "MARKER_FILE",
    "Frame",
    "Manifest",
    "Piece",
    "ShardStager",
    "Staged",
    "encode_piece",
    "payload_error",
    "write_part",
    "write_zero_metadata",
]

__getattr__, __dir__ = lazy_names(__name__)
