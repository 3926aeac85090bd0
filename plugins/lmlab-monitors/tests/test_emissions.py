"""emissions: a tiny run records its energy and CO2 in summary.json, with codecarbon offline (no
network, nothing written outside the run folder); the kg/kWh ratio is the country's carbon
intensity in codecarbon's own data; bad codes are refused by `lmlab check`, naming the key."""

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from lmlab.api import UserError
from lmlab.testing.runs import main
from lmlab_monitors.emissions import Emissions, EmissionsOptions
from lmlab.testing import stand_in_run

codecarbon = pytest.importorskip("codecarbon")


# What codecarbon does while a test records: every network call, and every file it writes, from any
# thread (its power readings run in their own). Audit hooks cannot be removed: one per process.
_RECORD: list | None = None
_WRITES = ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "os.truncate")


def _audit(event: str, args) -> None:
    if _RECORD is None:
        return
    if event in ("socket.connect", "socket.getaddrinfo", "socket.sendto", "socket.gethostbyname"):
        _RECORD.append((event, repr(args)))  # from anyone: a run with an offline tracker stays offline
    elif event == "open" and _writes(args) or event in _WRITES:
        frame = sys._getframe(1)
        while frame is not None:
            if "/codecarbon/" in frame.f_code.co_filename:
                _RECORD.append((event, str(args[0])))
                return
            frame = frame.f_back


def _writes(args) -> bool:
    path, mode, flags = args
    if isinstance(path, int) or path == os.devnull:  # pipes of the subprocess py-cpuinfo runs in
        return False
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return bool(flags & 0o3)  # O_WRONLY or O_RDWR


sys.addaudithook(_audit)


@pytest.fixture
def recording():
    global _RECORD
    _RECORD = []
    try:
        yield _RECORD
    finally:
        _RECORD = None


def _intensity_kg_per_kwh(country: str) -> float:
    """The carbon intensity codecarbon applies offline for a country without region."""
    from codecarbon.core.emissions import Emissions as CodecarbonEmissions
    from codecarbon.input import DataSource

    mix = DataSource().get_global_energy_mix_data()[country]
    return CodecarbonEmissions._global_energy_mix_to_emissions_rate(mix).kgs_per_kWh


def test_a_run_records_energy_and_co2_offline_inside_its_folder(tiny_manifest, tmp_path, recording):
    path = tiny_manifest('\n[monitor]\nuse = ["emissions"]\n\n[monitor.emissions]\ncountry_iso_code = "FRA"\n'
                         'measure_power_secs = 1.0\n')
    assert main(["run", str(path), "--out", str(tmp_path / "runs")]) == 0
    run_dir = tmp_path / "runs" / "default"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    energy, co2 = summary["energy_kwh"], summary["emissions_kg_co2"]
    assert isinstance(energy, float) and isinstance(co2, float)
    assert energy > 0 and co2 > 0  # RAM power alone is never zero
    assert summary["emissions_country"] == "FRA"
    assert co2 / energy == pytest.approx(_intensity_kg_per_kwh("FRA"), rel=1e-6)
    assert (run_dir / "emissions.csv").is_file()
    assert [e for e in recording if e[0].startswith("socket.")] == []  # never the network
    outside = [e for e in recording if not e[1].startswith(str(run_dir))]
    assert outside == []
    assert any(e[1] == str(run_dir / "emissions.csv") for e in recording)
    assert _codecarbon_timers_stop()


def _codecarbon_timers_stop(wait_s: float = 2.0) -> bool:
    """Whether every timer thread of codecarbon's power readings ends (cancelled when it stopped)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        timers = [t for t in threading.enumerate() if isinstance(t, threading.Timer)
                  and type(getattr(t.function, "__self__", None)).__module__.startswith("codecarbon")]
        if not timers:
            return True
        time.sleep(0.05)
    return False


class _Control:
    def __init__(self, run_dir):
        self.run_dir, self.is_main, self.rank = run_dir, True, 0
        self.run = stand_in_run(experiment="unit")
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


def _measure(tmp_path, country: str) -> dict:
    control = _Control(tmp_path / country)
    monitor = Emissions(EmissionsOptions(country_iso_code=country, measure_power_secs=1.0))
    monitor.lmlab_run_start(control=control)
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # some CPU to measure
        sum(range(10_000))
    out = monitor.lmlab_run_end(control=control)
    assert control.notes == []
    assert _codecarbon_timers_stop()
    return out


def test_a_coal_grid_emits_more_per_kwh_than_a_nuclear_one(tmp_path, recording):
    fra, pol = _measure(tmp_path, "FRA"), _measure(tmp_path, "POL")
    ratio = {c: r["emissions_kg_co2"] / r["energy_kwh"] for c, r in (("FRA", fra), ("POL", pol))}
    assert ratio["POL"] > 5 * ratio["FRA"]  # about 0.66 against 0.056 kg CO2 per kWh
    assert ratio["POL"] == pytest.approx(_intensity_kg_per_kwh("POL"), rel=1e-6)
    assert [e for e in recording if e[0].startswith("socket.")] == []
    assert all(e[1].startswith(str(tmp_path)) for e in recording)


def test_other_processes_do_not_measure(tmp_path):
    control = _Control(tmp_path / "run")
    control.is_main, control.rank = False, 1
    monitor = Emissions()
    monitor.lmlab_run_start(control=control)
    assert monitor.tracker is None
    assert monitor.lmlab_run_end(control=control) is None
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("code", ["usa", "US", "FRAN", "XYZ"])
def test_a_bad_country_code_is_refused_by_check(tiny_manifest, capsys, code):
    path = tiny_manifest(f'\n[monitor]\nuse = ["emissions"]\n\n[monitor.emissions]\ncountry_iso_code = "{code}"\n')
    assert main(["check", str(path)]) == 2
    assert "monitor.emissions.country_iso_code" in capsys.readouterr().err


@pytest.mark.parametrize(("country", "region"), [("USA", "atlantis"), ("DEU", "bavaria")])
def test_a_region_codecarbon_cannot_use_is_refused_by_check(tiny_manifest, capsys, country, region):
    path = tiny_manifest(f'\n[monitor]\nuse = ["emissions"]\n\n[monitor.emissions]\ncountry_iso_code = "{country}"\n'
                         f'region = "{region}"\n')
    assert main(["check", str(path)]) == 2
    assert "monitor.emissions.region" in capsys.readouterr().err


def test_a_known_region_passes_check(tiny_manifest):
    path = tiny_manifest('\n[monitor]\nuse = ["emissions"]\n\n[monitor.emissions]\ncountry_iso_code = "USA"\n'
                         'region = "California"\n')
    assert main(["check", str(path)]) == 0


def test_without_codecarbon_check_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "codecarbon" else real(name, *a))
    with pytest.raises(UserError) as refused:
        Emissions().check(None)
    assert refused.value.key == "monitor.use"
    assert "lmlab-monitors[emissions]" in refused.value.message


def test_importing_the_plugin_does_not_import_codecarbon():
    code = "import sys, lmlab_monitors.emissions; print('codecarbon' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
