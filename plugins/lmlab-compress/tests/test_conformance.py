"""Every compress method of this distribution passes lmlab.testing.check_compress: reloaded exactly,
bad options refused, its reported size that of the tensors it saves."""

import pytest

from lmlab.testing import check_compress, tiny_model
from lmlab.testing.compress import COMPRESS_SHAPE
from lmlab_compress.awq import AWQ, Int4
from lmlab_compress.grouped import RoundToNearest
from lmlab_compress.heads import HeadPrune
from lmlab_compress.int8 import Int8
from lmlab_compress.nf4 import NF4
from lmlab_compress.sparsity import Magnitude, Wanda

METHODS = [
    (Int8, None, {}), (NF4, None, {}), (RoundToNearest, None, {}), (RoundToNearest, {"bits": 3, "group_size": 64}, {}),
    # AWQ declares grid up to 1000, a search of minutes on the CPU: the kit tries its ends up to 20.
    (AWQ, {"grid": 4}, {"ranges": {"grid": (2, 20)}}), (Int4, None, {}), (Wanda, None, {}), (Magnitude, None, {}),
    # head pruning needs attention that can prune heads: the core's model with gqa.
    (HeadPrune, {"heads": 1}, {"model": lambda: tiny_model("gqa", "mlp", shape=COMPRESS_SHAPE)}),
]


@pytest.mark.parametrize("method, options, settings", METHODS,
                         ids=[f"{m.__name__}{o or ''}" for m, o, _ in METHODS])
def test_method_passes_the_kit(method, options, settings):
    check_compress(method, options, **settings)
