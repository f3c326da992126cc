"""A decode step captured in a CUDA graph and replayed with new lengths and new cache contents
gives bit-identical results to eager execution (GPU only)."""

import pytest
import torch

import moira
from moira import KernelOptions
from moira.config import PAGE_SIZE
from moira.synthetic import synthetic_context

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("gamma, top_k, schedule", [(0.95, None, "rows"), (1.0, None, "rows"),
                                                    (0.98, 12, "rows"),
                                                    (0.95, None, "balanced"),
                                                    (0.95, None, "rows, programmatic launch"),
                                                    (0.98, 12, "rows, programmatic launch"),
                                                    (0.95, None,
                                                     "rows, programmatic launch, short rows"),
                                                    (0.95, None,
                                                     "rows, programmatic launch, Triton Attend"),
                                                    (0.95, None, "rows, CUDA Attend"),
                                                    (0.95, None, "rows, CUDA Estimate"),
                                                    (0.95, None, "rows, CUDA Select"),
                                                    (0.98, 12, "rows, CUDA Select")])
def test_graph_replay_matches_eager(gamma, top_k, schedule):
    # "CUDA <Stage>" / "Triton <Stage>": that stage's CUDA kernel (launched through the driver
    # API) or Triton kernel, the others' as KernelOptions' defaults resolve them on this GPU
    # (Attend's CUDA kernel for the "rows" schedule: "Triton Attend" chains all four kernels
    # under programmatic launch)
    kernels = KernelOptions(**{stage: backend.lower() for backend in ("CUDA", "Triton")
                               for stage in ("estimate", "select", "attend")
                               if f"{backend} {stage.capitalize()}" in schedule})
    batch, num_kv_heads, group, head_dim, width = 4, 8, 4, 128, 96
    ctx = synthetic_context(width * PAGE_SIZE, batch=batch, num_kv_heads=num_kv_heads,
                            group=group, head_dim=head_dim, device="cuda", seed=1)
    # the step's query is written by a kernel inside the graph (as vLLM's rotary / cache-write
    # kernels precede attention), so Estimate's wait for its predecessor is exercised too
    staged_query = ctx.query.clone()
    query, keys, values = torch.empty_like(staged_query), ctx.key_cache.clone(), \
        ctx.value_cache.clone()
    table, seq_lens = ctx.block_table.clone(), ctx.seq_lens.clone()
    # zeros, not the default empty: pages no row fills must compare equal (NaN != NaN)
    summaries = moira.summarize(keys, table, seq_lens,
                                torch.zeros(keys.shape[0], num_kv_heads, 2, head_dim,
                                            dtype=keys.dtype, device="cuda"))
    out = torch.empty_like(query)
    workspace = moira.DecodeWorkspace(batch, width, num_kv_heads * group, num_kv_heads,
                                      head_dim, device="cuda",
                                      config=moira.MoiraConfig(
                                          schedule=schedule.split(",")[0], programs=264,
                                          programmatic_launch="programmatic" in schedule,
                                          dense_below_pages=48 if "short" in schedule else 0,
                                          kernels=kernels))
    # with programmatic launch, the same step launched plainly is the reference too: a kernel
    # reading before the previous one's writes land would differ from it
    plain = moira.DecodeWorkspace(batch, width, num_kv_heads * group, num_kv_heads, head_dim,
                                  device="cuda", config=workspace.config.replace(
                                      programmatic_launch=False))

    def poison():
        """Scratch and output of the last step overwritten, so that an eager step reading a
        buffer before its producer wrote it cannot pass on the previous step's values."""
        for buffer in (workspace.log_masses, workspace.partial_out, workspace.partial_lse, out):
            buffer.fill_(float("nan"))
        workspace.page_lists.fill_(-1)
        workspace.page_counts.fill_(-1)

    def step():  # a decode step: its Estimate summarizes each row's page once full
        torch.mul(staged_query, 1.0, out=query)
        return moira.sparse_decode(query, keys, values, summaries, table, seq_lens,
                                   gamma=gamma, top_k=top_k, workspace=workspace, out=out,
                                   return_pages=True)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, graph_lists, graph_counts = step()

    generator = torch.Generator().manual_seed(0)
    for trial in range(4):
        # new contents, in place; new lengths including a padded row, and a row whose current
        # page "this step" filled, so the graph's Estimate has a summary to write
        fresh = synthetic_context(width * PAGE_SIZE, batch=batch, num_kv_heads=num_kv_heads,
                                  group=group, head_dim=head_dim, device="cuda", seed=10 + trial)
        staged_query.copy_(fresh.query)
        keys.copy_(fresh.key_cache)
        values.copy_(fresh.value_cache)
        lengths = torch.randint(1, width * PAGE_SIZE + 1, (batch,), generator=generator)
        lengths[trial % batch] = 0
        lengths[(trial + 1) % batch] = PAGE_SIZE * int(torch.randint(1, width, (1,)))
        seq_lens.copy_(lengths.to(torch.int32))
        moira.summarize(keys, table, seq_lens, summaries)
        b = (trial + 1) % batch
        last_page = table[b, int(lengths[b]) // PAGE_SIZE - 1]
        summaries[last_page] = float("nan")  # only the captured Estimate can repair it

        graph.replay()
        torch.cuda.synchronize()
        replayed = (out.clone(), graph_lists.clone(), graph_counts.clone(), summaries.clone())
        assert not torch.isnan(summaries[last_page]).any()

        summaries[last_page] = float("nan")
        poison()
        eager_out, eager_lists, eager_counts = step()
        torch.cuda.synchronize()
        assert torch.equal(replayed[0], eager_out)
        assert torch.equal(replayed[2], eager_counts)
        for row in range(batch):
            for head in range(num_kv_heads):
                n = int(eager_counts[row, head])
                assert torch.equal(replayed[1][row, head, :n], eager_lists[row, head, :n])
        assert torch.equal(replayed[3], summaries)
        if workspace.config.programmatic_launch:
            plain_out = moira.sparse_decode(query, keys, values, summaries, table, seq_lens,
                                            gamma=gamma, top_k=top_k, workspace=plain)
            torch.cuda.synchronize()
            assert torch.equal(plain_out, eager_out)
        assert not torch.isnan(eager_out).any()
        assert (eager_out[trial % batch] == 0).all()
