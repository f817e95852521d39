"""`make demo`'s table, without engines: missing values print as dashes with a
reason, and the table names the CPU and dtype it ran on."""

import importlib.util

from tests.conftest import REPO


def _demo():
    spec = importlib.util.spec_from_file_location("demo", REPO / "examples" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_table_prints_missing_values_as_dashes_with_a_reason():
    demo = _demo()
    machine = {"cpu": "AMD EPYC 9R14", "cores": 2, "cpu_flags": ["avx2", "avx512f"]}
    base = [{"concurrency": 1, "tokens_per_s": 250.0}, {"concurrency": 16, "tokens_per_s": 3000.0}]
    dspark = [{"concurrency": 1, "tokens_per_s": 300.0, "mean_accepted_length": 2.5},
              {"concurrency": 16, "tokens_per_s": 2990.0, "mean_accepted_length": None,
               "controller": {"dormant": True}}]
    table = demo.format_table(base, dspark, machine, "bfloat16")
    lines = table.splitlines()
    assert "AMD EPYC 9R14 x2 (avx2, avx512f), bfloat16" in lines[0]
    assert "1.20x" in lines[2] and "2.50" in lines[2]
    assert lines[3].split()[-2:] == ["-", "*"] and "1.00x" in lines[3]
    assert lines[-1].endswith(demo.DORMANT)


def test_table_survives_a_row_with_nothing_measured():
    demo = _demo()
    table = demo.format_table([{"concurrency": 4, "tokens_per_s": None}],
                              [{"concurrency": 4, "tokens_per_s": None, "mean_accepted_length": None}], {}, "float32")
    assert "? x? (no AVX2/AVX-512/AMX), float32" in table
    assert table.splitlines()[2].split()[:4] == ["4", "-", "-", "-"]
    assert table.endswith(demo.NOTHING_VERIFIED)


def test_demo_dtype_follows_the_cpu_s_bf16_instructions():
    from vllm_dspark.fingerprint import cpu_dtype

    assert cpu_dtype(["avx2", "avx512f", "avx512_bf16"]) == "bfloat16"
    assert cpu_dtype(["avx2", "amx_bf16", "amx_tile"]) == "bfloat16"
    assert cpu_dtype(["avx2", "avx512f"]) == cpu_dtype(["avx2"]) == "float32"
