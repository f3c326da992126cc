import pytest
import torch

from moira import KernelOptions, MoiraConfig
from moira.kernels.tuning import TUNABLES


def test_defaults():
    config = MoiraConfig()
    assert (config.gamma, config.chunk_pages, config.min_chunks_per_row, config.min_programs) == (
        0.98, 24, 32, 4096)  # the paper's
    # K_B tuned on the H200: 4 up to 4,095 pages (the paper: 2 from 1,024)
    assert [config.bisection_ways_for(n) for n in (1, 255, 256, 1023, 1024, 4095, 4096,
                                                   40000)] == [8, 8, 4, 4, 4, 4, 2, 2]
    paper = MoiraConfig(bisection_ways=((256, 8), (1024, 4), (4096, 2)))
    assert [paper.bisection_ways_for(n) for n in (255, 1023, 1024, 5000)] == [8, 4, 2, 2]


def test_chunks_per_row_is_eq4_below_its_ceiling():
    config = MoiraConfig()
    assert config.chunks_per_row(32) == 128  # 131k x 4 on Llama: ceil(4096 / 32)
    assert config.chunks_per_row(256) == 32  # 8k x 32: N_J wins
    assert config.chunks_per_row(100) == 41
    # one or two requests: at most max_chunks_per_row (128), not 512 / 256
    assert [config.chunks_per_row(rows) for rows in (8, 16, 31)] == [128, 128, 128]
    assert config.replace(max_chunks_per_row=4096).chunks_per_row(8) == 512  # Eq. 4 alone
    assert config.replace(max_chunks_per_row=32).chunks_per_row(8) == 32


def test_chunks_per_row_capped_by_the_block_table():
    config = MoiraConfig()
    assert config.chunks_per_row(32, max_pages=2048) == 86  # ceil(2048 / 24) < 128
    assert config.chunks_per_row(8, max_pages=2048) == 128  # the ceiling, below ceil(2048 / 6)
    assert config.chunks_per_row(8, max_pages=517) == 87  # one request: C = 6, not 512
    assert config.chunks_per_row(256, max_pages=10_000) == 32  # no cap when it does not bind
    # the short-row floor's chunks (about T / rows) are never capped away by the width (only
    # by max_chunks_per_row, in steps of fewer than T / 128 rows): 2k x 1 in an engine
    # of 133 pages per row keeps 32 at the default T = 256 (32 programs per row), and 23
    # (ceil(133 / C), C = 6) with T = 128
    assert config.chunks_per_row(8, max_pages=133) == 32
    assert config.replace(step_programs=128).chunks_per_row(8, max_pages=133) == 23


def test_chunk_floor_shrinks_for_small_batches():
    config = MoiraConfig()  # C = 24 from 32 rows (4 requests x 8 KV heads) up
    assert [config.chunk_floor(rows) for rows in (256, 32, 16, 8, 2, 1)] == [24, 24, 12, 6, 2, 2]
    assert MoiraConfig(chunk_pages=1).chunk_floor(1) == 1  # never above chunk_pages


@pytest.mark.parametrize("field, value", [
    ("gamma", 0.0), ("gamma", -0.1), ("gamma", 1.01), ("gamma", float("nan")), ("gamma", "0.9"),
    ("top_k", 1), ("top_k", 2.5), ("chunk_pages", 0), ("floor_rows", 0), ("min_chunks_per_row", -1),
    ("min_programs", 1.5), ("bisection_ways", ((256, 3),)), ("bisection_ways", ((256, 32),)),
    ("bisection_ways", ((1024, 8), (256, 4))), ("bisection_ways", ()),
    ("programmatic_launch", "yes"), ("step_programs", -1), ("step_programs", 1.5),
    ("step_programs", True), ("max_chunks_per_row", 0), ("max_chunks_per_row", 31),
    ("step_programs", 89478486),  # * 24 pages = 2**31 + 16: the int32 floor would overflow
    # sizes a workspace or a grid could not hold, and K_B beyond what a pass holds on chip
    ("min_programs", 2**40), ("programs", 2**21), ("chunk_pages", 2**21),
    ("max_chunks_per_row", 65536), ("bisection_ways", ((32768, 2**24),)),
    ("bisection_ways", ((float("nan"), 4),)), ("bisection_ways", (("256", 4),)),
    ("bisection_ways", ((True, 4),)), ("bisection_ways", (4,)),
])
def test_bad_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        MoiraConfig(**{field: value})


def test_bisection_ways_from_json_lists_are_held_as_tuples():
    config = MoiraConfig(bisection_ways=[[256, 8], [4096, 4]])
    assert config.bisection_ways == ((256, 8), (4096, 4)) and hash(config) == hash(
        MoiraConfig(bisection_ways=((256, 8), (4096, 4))))


def test_the_largest_step_programs_for_the_chunk_floor_is_accepted():
    assert MoiraConfig(step_programs=89478485).step_programs == 89478485  # * 24 < 2**31


def test_gamma_accepts_numpy_floats():
    import numpy as np

    assert MoiraConfig(gamma=np.float32(0.5)).gamma == 0.5  # e.g. from a NumPy sweep
    top_k = MoiraConfig(top_k=np.int64(4)).top_k  # numpy's ints too, held as int
    assert top_k == 4 and type(top_k) is int
    with pytest.raises(ValueError, match="gamma"):
        MoiraConfig(gamma=np.float32(1.5))


def test_gamma_one_and_replace():
    config = MoiraConfig(gamma=1.0)
    assert config.replace(top_k=8).top_k == 8
    with pytest.raises(ValueError, match="gamma"):
        config.replace(gamma=2.0)


def test_programmatic_launch_is_off_in_the_interpreter_and_only_for_the_rows_schedule():
    from moira.kernels import interpreting, launch

    assert MoiraConfig().programmatic_launch is False
    with pytest.raises(ValueError, match="programmatic_launch chains"):
        MoiraConfig(programmatic_launch=True, schedule="balanced")
    # the CPU interpreter cannot run griddepcontrol: the launchers then launch plainly
    expected = dict(PDL=False) if interpreting() else dict(PDL=True, launch_pdl=True)
    assert launch.options(True, "attend") == expected
    assert launch.options(False, "attend") == dict(PDL=False)


def test_a_kernel_left_out_of_the_programmatic_chain_launches_plainly(monkeypatch):
    from moira.kernels import launch

    monkeypatch.setattr(launch, "interpreting", lambda: False)  # as on a GPU
    assert launch.options(True, "attend") == dict(PDL=True, launch_pdl=True)
    chained = KernelOptions(tuning={"launch.chained": "estimate,select,merge"}).value(
        "launch.chained")
    assert launch.options(True, "attend", chained) == dict(PDL=False)
    assert launch.options(True, "merge", chained) == dict(PDL=True, launch_pdl=True)
    assert launch.options(False, "merge", chained) == dict(PDL=False)


def test_kernel_options_defaults_and_values():
    options = KernelOptions()
    assert (options.estimate, options.select, options.attend, options.fused) \
        == ("auto", "triton", "auto", "auto")
    assert options.value("attend.cuda_stages") == TUNABLES["attend.cuda_stages"].default
    tuned = KernelOptions(attend="triton", tuning={"attend.num_warps": 8})
    assert tuned.value("attend.num_warps") == 8 and tuned.tuning == (("attend.num_warps", 8),)
    assert hash(MoiraConfig(kernels=tuned)) == hash(MoiraConfig(kernels=KernelOptions(
        attend="triton", tuning={"attend.num_warps": 8})))
    assert MoiraConfig(kernels={"attend": "triton"}).kernels == KernelOptions(attend="triton")


@pytest.mark.parametrize("kwargs, match", [
    (dict(attend="gpu"), "KernelOptions.attend must be one of"),
    (dict(fused="yes"), "KernelOptions.fused must be one of"),
    (dict(tuning={"attend.warps": 4}), "unknown tuning 'attend.warps'"),
    (dict(tuning={"attend.cuda_stages": 5}, attend="cuda"), "'attend.cuda_stages' must be one of"),
    (dict(tuning={"fused.min_rows": -1}), "'fused.min_rows' must be an int in"),
    (dict(tuning={"estimate.query_head_ahead": 1}, estimate="triton"), "must be one of"),
    (dict(tuning=[1, 2]), "tuning must be a mapping"),
    # a kernel's constant needs that kernel named: under "auto" it might not run
    (dict(tuning={"attend.num_warps": 8}), "read only by the triton kernel.*attend='auto'"),
    (dict(attend="cuda", tuning={"attend.page_ids_ahead": True}), "attend='cuda'"),
    (dict(select="triton", tuning={"estimate.cuda_target_programs": 330}),
     "estimate='auto'"),
])
def test_kernel_options_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KernelOptions(**kwargs)


def test_kernel_options_parse_the_string_form():
    options = KernelOptions.parse("attend=triton, fused=off,attend.num_warps=8,"
                                  "attend.max_registers=none,attend.page_ids_ahead=true")
    assert options == KernelOptions(attend="triton", fused="off", tuning={
        "attend.num_warps": 8, "attend.max_registers": None, "attend.page_ids_ahead": True})
    assert KernelOptions.parse("") == KernelOptions()
    for text, match in [("attend", "use NAME=VALUE"), ("gpu=1", "kernel option 'gpu'"),
                        ("attend=triton,attend.num_warps=many", "attend.num_warps")]:
        with pytest.raises(ValueError, match=match):
            KernelOptions.parse(text)
    with pytest.raises(ValueError, match="unknown keys"):
        KernelOptions.from_mapping({"attend": "triton", "warps": 4})


def test_workspace_resolves_backends_once():
    import moira

    if torch.cuda.is_available():
        pytest.skip("on a GPU the CUDA kernels may run; tests/test_*_cuda.py cover that")
    workspace = moira.DecodeWorkspace(2, 8, 8, 2, 64, device="cpu")
    assert workspace.backends == {"estimate": "triton", "select": "triton",
                                  "attend": "triton", "fused": "off"}
    for stage in ("estimate", "select", "attend"):  # an explicit "cuda" cannot run here
        with pytest.raises(ValueError, match=rf"KernelOptions\({stage}='cuda'\) cannot run"):
            moira.DecodeWorkspace(2, 8, 8, 2, 64, device="cpu", config=MoiraConfig(
                kernels=KernelOptions(**{stage: "cuda"})))
