"""The parallel layers' sharding, without processes: each rank's layer is built in this process
(the rank and world size patched in), loads its shard from the full tensor, and the ranks'
outputs are combined the way the collectives would (sum for all-reduce, concat for all-gather)
and compared with the unsharded computation. The real collectives run in tests/e2e."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.worker.models import parallel_layers as pl

WORLD = 2


@pytest.fixture
def as_rank(monkeypatch):
    """as_rank(r) makes layers built next think they are rank r of WORLD; collectives are identity."""
    monkeypatch.setattr(pl, "all_reduce", lambda x: x)
    monkeypatch.setattr(pl, "all_gather_last_dim", lambda x: x)
    monkeypatch.setattr(pl, "get_tp_world_size", lambda: WORLD)

    def set_rank(rank: int) -> None:
        monkeypatch.setattr(pl, "get_tp_rank", lambda: rank)

    return set_rank


def test_column_parallel_with_replicated_kv(as_rank) -> None:
    torch.manual_seed(0)
    hidden, head_dim, heads, kv_heads = 8, 2, 4, 1  # 1 KV head, 2 ranks: replicated
    wq, wk, wv = torch.randn(heads * head_dim, hidden), torch.randn(head_dim, hidden), torch.randn(head_dim, hidden)
    bq = torch.randn(heads * head_dim)
    x = torch.randn(3, hidden)
    q_parts = []
    for rank in range(WORLD):
        as_rank(rank)
        q_local = heads // WORLD * head_dim
        layer = pl.ColumnParallelLinear(hidden, {"q": pl.ShardSpec(q_local, rank, heads * head_dim),
                                                 "k": pl.ShardSpec(head_dim, 0, kv_heads * head_dim),
                                                 "v": pl.ShardSpec(head_dim, 0, kv_heads * head_dim)}, bias=True)
        layer.bias.data.zero_()
        for shard_id, w in (("q", wq), ("k", wk), ("v", wv)):
            layer.load_weight("weight", w, shard_id)
        layer.load_weight("bias", bq, "q")
        q, k, v = layer(x).split([q_local, head_dim, head_dim], dim=-1)
        q_parts.append(q)
        torch.testing.assert_close(k, x @ wk.T)  # every rank holds the one KV head
        torch.testing.assert_close(v, x @ wv.T)
    torch.testing.assert_close(torch.cat(q_parts, dim=-1), F.linear(x, wq, bq))


def test_row_parallel_sums_to_the_full_layer_with_bias_once(as_rank) -> None:
    torch.manual_seed(1)
    w, b, x = torch.randn(5, 8), torch.randn(5), torch.randn(3, 8)
    total = torch.zeros(3, 5)
    for rank in range(WORLD):
        as_rank(rank)
        layer = pl.RowParallelLinear(8, 5, bias=True)
        layer.load_weight("weight", w)
        layer.load_weight("bias", b)
        total += layer(x[:, rank * 4 : (rank + 1) * 4])  # its input arrives split, from a column layer
    torch.testing.assert_close(total, F.linear(x, w, b))


def test_vocab_parallel_embedding_and_logits_with_padding(as_rank) -> None:
    torch.manual_seed(2)
    vocab, hidden = 7, 4  # not divisible by 2: 4 rows per rank, the last one padding
    table, ids, h = torch.randn(vocab, hidden), torch.tensor([0, 3, 4, 6]), torch.randn(2, hidden)
    summed, logit_parts = torch.zeros(4, hidden), []
    for rank in range(WORLD):
        as_rank(rank)
        emb = pl.VocabParallelEmbedding(vocab, hidden)
        emb.load_weight("weight", table)
        assert emb.weight.shape == (4, hidden)
        summed += emb(ids)
        logit_parts.append(F.linear(h, emb.weight))
    torch.testing.assert_close(summed, F.embedding(ids, table))
    torch.testing.assert_close(torch.cat(logit_parts, dim=-1)[:, :vocab], h @ table.T)
    assert torch.all(logit_parts[1][:, -1] == 0)  # the padding row is zero (and cut off)


def test_shape_mismatch_is_a_clear_error(as_rank) -> None:
    as_rank(0)
    layer = pl.RowParallelLinear(8, 5, bias=False)
    with pytest.raises(ValueError, match="expected"):
        layer.load_weight("weight", torch.randn(5, 6))
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size"):
        pl.RowParallelLinear(7, 5, bias=False)
