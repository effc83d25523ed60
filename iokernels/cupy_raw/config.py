"""One config class per op of the CuPy kernels: the sizes a .cu file is compiled with.

This module re-exports them from their homes (:mod:`.forward_config`, :mod:`.decode_config`,
:mod:`.backward_config`, :mod:`.gather_config`, :mod:`.mla_config`,
:mod:`.paged_prefill_config`); the size rules they call
for their defaults are :mod:`.policy`'s.

Every config is a frozen dataclass whose first field is ``version`` ("v1", "v2", ...;
None: the default, which :data:`iokernels.cupy_raw.REGISTRY` picks for each call).  Its
other fields are the tile sizes and settings of that version, injected into the kernel as
``-D`` defines; each config knows the shared memory (SRAM) its tiles take, so a size that
does not fit the GPU is a ValueError naming ``config.<field>`` before anything is launched.
Sizes left as None are chosen per call so that the tiles fit (:func:`fit_config`, and the
ring depth of decode v3), for every supported dtype and head dim up to 256.

Notation (the papers' names):

=======  ===========================================================================
Br, Bc   query rows per thread block, key/value rows per K/V tile (block_q, block_k)
d        head dim; ``D_PAD`` rounds it up to the 16 a tensor-core step covers
g        query heads per KV head (GQA group), what one decode block serves
S        splits of the key axis (Flash-Decoding)
SRAM     shared memory of one thread block; HBM device memory
=======  ===========================================================================
"""
from .forward_config import *  # noqa: F401,F403
from .gather_config import *  # noqa: F401,F403
from .backward_config import *  # noqa: F401,F403
from .mla_config import *  # noqa: F401,F403
from .paged_prefill_config import *  # noqa: F401,F403
from .decode_config import *  # noqa: F401,F403
from .decode_config import MMA_K  # noqa: F401
