"""The bench scripts run end to end on CPU (--dry-run, interpreter), and ncu's CSV is read right."""
import csv
import os
import subprocess
import sys

from numasched.bench import policies

NCU_LOG = '''==PROF== Connected to process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3","127.0.0.1","gemm_kernel","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,234,567"
"0","4242","python3","127.0.0.1","gemm_kernel","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","lts__t_sector_hit_rate.pct","%","87.5"
"1","4242","python3","127.0.0.1","attn_fwd_kernel","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","lts__t_sector_hit_rate.pct","%","42.25"
"1","4242","python3","127.0.0.1","attn_fwd_kernel","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","n/a"
'''


def test_ncu_csv_gives_one_record_per_kernel_in_launch_order():
    ks = policies._parse_ncu_csv(NCU_LOG)
    assert [k["kernel"] for k in ks] == ["gemm_kernel", "attn_fwd_kernel"]
    assert ks[0]["dram__bytes_read.sum"] == 1234567.0        # thousands separators dropped
    assert ks[0]["lts__t_sector_hit_rate.pct"] == 87.5
    assert ks[1]["lts__t_sector_hit_rate.pct"] == 42.25
    assert "gpu__time_duration.sum" not in ks[1]              # an unreadable value is left out, not 0
    assert policies._parse_ncu_csv("no profiler output") == []


def test_policies_dry_run_times_every_registered_policy(tmp_path):
    from numasched import mappings as M

    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "numasched.bench.policies", "--dry-run", "--quick", "--out-dir",
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (path,) = tmp_path.glob("policies-*.csv")
    rows = list(csv.DictReader(open(path)))
    for kind, label in (("prefill", "attention"), ("decode", "decode"), ("gemm", "gemm")):
        got = {row["policy"] for row in rows if row["kind"] == kind}
        assert got == set(M.available(label)), kind
    assert all(float(row["ms"]) > 0 for row in rows)
