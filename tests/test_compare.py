"""`lmlab compare`: seeds pooled per variant, Welch's test against a baseline (checked against SciPy),
the HTML report rendered by headless Chromium, the PNG plots, W&B as a source, and bad input."""

import json
import os
import shutil
import statistics
import subprocess

import pytest

from lmlab.cli.main import main
from lmlab.report import runs as sources
from lmlab.report.stats import incomplete_beta, welch
from lmlab.report.table import summarize

LOSSES = {"attention.use=mha": [1.50, 1.52, 1.49], "attention.use=mqa": [1.40, 1.43, 1.41],
          "attention.use=gqa": [1.51, 1.47, 1.53]}


def write_run(root, name, val_loss, tokens_per_s=1000.0, status="completed", **extra):
    run_dir = root / name
    run_dir.mkdir(parents=True)
    summary = {"status": status, "val_loss": val_loss, "tokens_per_s": tokens_per_s, "peak_mem_mb": 100.0,
               "params": 1234, "activation_mb": 2.0, "state_mb": 1.0, **extra}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    records = [{"step": s, "train_loss": val_loss + 1.0 / s, "lr": 1e-3, "tokens_per_s": tokens_per_s}
               for s in range(1, 11)]
    records += [{"step": 5, "val_loss": val_loss + 0.1}, {"step": 10, "val_loss": val_loss + 0.01},
                {"step": 10, "val_loss": val_loss, "final": True}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def runs_dir(tmp_path):
    root = tmp_path / "runs"
    for variant, values in LOSSES.items():
        for seed, loss in enumerate(values, 1):
            write_run(root, f"{variant},seed={seed}", loss, tokens_per_s=1000.0 * seed)
    write_run(root, "attention.use=gqa,seed=4", 9.9, status="failed", error="RuntimeError: boom")
    (root / "sweep.json").write_text(json.dumps({"groups": list(LOSSES)}))
    return root


def test_welch_test_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    cases = [([1.5, 1.52, 1.49], [1.4, 1.43, 1.41]), ([2.0, 2.1], [2.05, 2.3, 1.9, 2.2]),
             ([0.1, 0.2, 0.3, 0.4, 0.5], [10.0, 10.5]), ([3.0, 3.0001], [3.0, 3.0002])]
    for a, b in cases:
        ours, reference = welch(a, b), stats.ttest_ind(a, b, equal_var=False)
        assert ours.t == pytest.approx(reference.statistic, rel=1e-9)
        assert ours.p == pytest.approx(reference.pvalue, rel=1e-7, abs=1e-14)
    special = pytest.importorskip("scipy.special")
    for a, b, x in ((0.5, 0.5, 0.3), (2.0, 0.5, 0.9), (30.0, 0.5, 0.999), (1.5, 7.0, 0.01)):
        assert incomplete_beta(a, b, x) == pytest.approx(special.betainc(a, b, x), rel=1e-10)
    assert welch([1.0], [1.0, 2.0]) is None  # one seed: no test


def test_table_pools_seeds_tests_against_the_baseline_and_lists_left_out_runs(runs_dir, capsys):
    assert main(["compare", str(runs_dir)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    rows = {line.split()[0]: line for line in lines[2:5]}
    assert list(rows) == list(LOSSES)  # sweep order, baseline first
    stats = pytest.importorskip("scipy.stats")
    for variant, values in LOSSES.items():
        row = rows[variant]
        assert f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}" in row and f"{min(values):.4f}" in row
        if variant != "attention.use=mha":
            p = stats.ttest_ind(values, LOSSES["attention.use=mha"], equal_var=False).pvalue
            assert f"{p:.2g}" in row
    assert "baseline" in rows["attention.use=mha"] and "better" in rows["attention.use=mqa"]
    assert "≈ baseline" in rows["attention.use=gqa"] and "3 (+1 failed)" in rows["attention.use=gqa"]
    assert "2,000" in rows["attention.use=mha"]  # tokens/s: the median over seeds 1000, 2000, 3000
    assert "left out: attention.use=gqa,seed=4 (failed: RuntimeError: boom)" in out

    assert main(["compare", str(runs_dir), "--baseline", "attention.use=mqa,seed=2"]) == 0  # the seed is ignored
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:5]}
    assert "worse" in rows["attention.use=mha"] and "baseline" in rows["attention.use=mqa"]


def test_bad_input_is_one_line_and_exit_2(runs_dir, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ([str(empty)], "holds no runs"),
        ([str(tmp_path / "missing")], "no such folder"),
        ([str(runs_dir), "--baseline", "attention.use=mhaa"], "did you mean 'attention.use=mha'"),
        ([str(runs_dir), "--metric", "bleu"], "no run reports 'bleu'"),
        ([], "either a runs folder or --wandb"),
        ([str(runs_dir), "--wandb", "team/project"], "either a runs folder or --wandb"),
    ]
    for args, message in cases:
        assert main(["compare", *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err

    # Runs of different metrics: some report a metric the others lack.
    write_run(runs_dir, "attention.use=mla,seed=1", 1.3, bleu=0.4)
    assert main(["compare", str(runs_dir), "--metric", "bleu"]) == 2
    err = capsys.readouterr().err
    assert "runs of different metrics" in err and "attention.use=mha,seed=1" in err


def test_numbers_agree_with_metrics_jsonl(runs_dir):
    """The table's values are the closing validation recorded in each run's metrics.jsonl."""
    comparison = summarize(sources.from_folder(runs_dir))
    for row in comparison.rows:
        direct = []
        for name in row.seeds:
            records = [json.loads(line) for line in (runs_dir / name / "metrics.jsonl").read_text().splitlines()]
            direct.append([r["val_loss"] for r in records if r.get("final")][-1])
        assert row.values == direct
        assert row.mean == pytest.approx(statistics.mean(direct))


def test_png_plots_and_an_html_report_that_chromium_renders(runs_dir, tmp_path, capsys):
    report, png = tmp_path / "report.html", tmp_path / "plots"
    assert main(["compare", str(runs_dir), "--html", str(report), "--png", str(png)]) == 0
    import matplotlib.image

    for name in ("curves", "metric", "throughput", "memory"):
        image = matplotlib.image.imread(png / f"{name}.png")
        assert image.shape[0] > 200 and image.shape[1] > 300 and image[..., :3].std() > 0.05, name
    text = report.read_text()
    assert text.count("<svg") == 4 and "attention.use=mqa" in text and "≈ baseline" in text
    assert "src=\"http" not in text and "<script" not in text  # self-contained

    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        if os.environ.get("LMLAB_REQUIRE_CHROMIUM"):
            pytest.fail("chromium is required here (LMLAB_REQUIRE_CHROMIUM is set) but not installed")
        pytest.skip("no chromium on this machine (CI installs it)")
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1200,1600", f"--screenshot={shot}", report.as_uri()],
                   capture_output=True, timeout=120, check=True)
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (1600, 1200)
    # Not blank: the plots put many distinct colours on the page, and a good share of it is not white.
    colours = {tuple(p) for p in (pixels[::4, ::4].reshape(-1, 3) * 255).round().astype(int).tolist()}
    assert len(colours) > 200 and (pixels.mean(axis=2) < 0.9).mean() > 0.03


class FakeWandbRun:
    def __init__(self, name, val_loss):
        self.name = name
        self.summary = {"status": "completed", "val_loss": val_loss, "tokens_per_s": 500.0, "_runtime": 3}
        self._history = [{"_step": 10, "train_loss": val_loss + 0.5, "val_loss": None},
                         {"_step": 20, "train_loss": val_loss + 0.2, "val_loss": val_loss}]

    def scan_history(self):
        return iter(self._history)


class FakeApi:
    def __init__(self):
        self.asked = None

    def runs(self, path, filters):
        self.asked = (path, filters)
        return [FakeWandbRun(f"{v},seed={s}", loss) for v, values in LOSSES.items() for s, loss in enumerate(values, 1)]


def test_runs_can_come_from_the_wandb_api():
    api = FakeApi()
    runset = sources.from_wandb("team/lmlab/attention-ablation", api=api)
    assert api.asked == ("team/lmlab", {"group": "attention-ablation"})
    comparison = summarize(runset, baseline="attention.use=mha")
    assert {row.variant: row.values for row in comparison.rows} == LOSSES
    run = runset.runs[0]
    assert run.metrics == [{"train_loss": run.summary["val_loss"] + 0.5, "step": 10},
                           {"train_loss": run.summary["val_loss"] + 0.2, "val_loss": run.summary["val_loss"], "step": 20}]
    assert "_runtime" not in run.summary
