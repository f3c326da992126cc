"""How a step's Attend work is split, on the host: the launch shape and the per-row plan's
parameters that every Attend and Merge kernel (Triton and CUDA) and the reference share.

The grid depends on the batch shape alone (never on row lengths, which only the GPU knows), so
a CUDA graph captured for a padded batch replays the same split; each program then plans its
own chunk from its row's list length (paper Eq. 4; the kernels' ``plan_row``):

    c = max(floor, ceil(n / J))      pages per chunk, floor = C or the short-row floor
    m = ceil(n / c)                  chunks of the row

Why each constant is what it is: docs/design/work-split.md.
"""


def short_row_pages(chunk_floor, step_rows, step_programs):
    """The longest row the short-row floor cuts finer than C: min(C, max(2, ceil(n * rows /
    T))) < C exactly when n * rows <= (C - 1) * T (for C > 2; at C <= 2 it never binds);
    -1 when it is off. Kernels test a row against it before any arithmetic of the floor."""
    if not step_programs or chunk_floor <= 2:
        return -1
    assert chunk_floor * step_programs < 2**31, "the floor is planned in int32: lower T or C"
    return (chunk_floor - 1) * step_programs // step_rows


def rows_plan(config, rows, max_pages):
    """The "rows" schedule's launch for a step planned for ``rows`` rows (a captured graph's
    padded batch x KV heads) in a block table of ``max_pages`` pages: the keywords of the Attend
    and Merge launchers (``chunk_floor`` C, ``chunks_per_row`` J, ``step_rows``,
    ``step_programs`` T)."""
    return dict(chunk_floor=config.chunk_floor(rows),
                chunks_per_row=config.chunks_per_row(rows, max_pages),
                step_rows=rows, step_programs=config.step_programs)
