"""Properties of the ``rope`` position plugin."""

import pytest
import torch

from lmlab.api import ModelShape, UserError
from lmlab_position.rope import RotaryPosition


def make_rope(base: float = 10000.0, d_model: int = 32, n_heads: int = 4, block_size: int = 16):
    shape = ModelShape(n_layers=1, d_model=d_model, n_heads=n_heads, block_size=block_size, vocab_size=11)
    return RotaryPosition(RotaryPosition.Options(base=base)).build(shape)


@pytest.mark.parametrize("positions", [torch.arange(12), torch.arange(20, 32), torch.tensor([0, 3, 15, 16, 40, 1000])],
                         ids=["inside-block", "beyond-block", "scattered"])
@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_rope_matches_hugging_face_llama(positions, base):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         rope_parameters={"rope_type": "default", "rope_theta": base})
    torch.manual_seed(0)
    T = len(positions)
    q, k = torch.randn(2, 4, T, 8), torch.randn(2, 2, T, 8)  # fewer key heads, as in GQA
    cos, sin = llama.LlamaRotaryEmbedding(config)(q, positions[None])
    expected_q, expected_k = llama.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = make_rope(base).rotate(q, k, positions)
    assert (got_q - expected_q).abs().max() <= 1e-6
    assert (got_k - expected_k).abs().max() <= 1e-6


def test_rope_preserves_norms():
    q, k = torch.randn(2, 4, 20, 8), torch.randn(2, 1, 20, 8)
    rq, rk = make_rope().rotate(q, k, torch.arange(20))
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(rk.norm(dim=-1), k.norm(dim=-1))
    assert not torch.allclose(rq[:, :, 1:], q[:, :, 1:])  # it did rotate (position 0 is the identity)


def test_rope_scores_depend_only_on_relative_position():
    rope = make_rope()
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def score(m: int, n: int) -> float:
        rq, _ = rope.rotate(q, k, torch.tensor([m]))
        _, rk = rope.rotate(q, k, torch.tensor([n]))
        return (rq * rk).sum().item()

    same_offset = [score(m, m - 3) for m in (3, 7, 15, 16, 50)]  # inside and beyond the tabulated block
    assert max(same_offset) - min(same_offset) < 1e-5
    assert abs(score(7, 4) - score(7, 5)) > 1e-3


def test_rope_reaches_past_the_block_size_and_keeps_no_state_in_checkpoints():
    rope = make_rope(block_size=16)
    assert rope.max_positions is None
    assert rope.state_dict() == {}  # cos/sin tables are derived, not learned


def test_rope_rejects_odd_head_size():
    with pytest.raises(UserError) as error:
        make_rope(d_model=12, n_heads=4)
    assert error.value.key == "position.use"


def test_rope_rotates_each_row_by_its_own_positions():
    rope = make_rope()
    assert rope.per_row
    torch.manual_seed(0)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [40, 41, 42, 1000, 3]])  # (B, T)
    q, k = torch.randn(3, 4, 5, 8), torch.randn(3, 2, 5, 8)  # fewer key heads, as in GQA
    got_q, got_k = rope.rotate(q, k, positions)
    for b in range(3):  # exactly what the row gets alone, with (T,) positions
        row_q, row_k = rope.rotate(q[b:b + 1], k[b:b + 1], positions[b])
        assert torch.equal(got_q[b:b + 1], row_q) and torch.equal(got_k[b:b + 1], row_k)
    assert not torch.allclose(got_q[1:], rope.rotate(q, k, positions[0])[0][1:])  # the rows' positions differ
