"""emissions: the energy a run used and the CO₂ that energy emitted, measured with codecarbon
(https://github.com/mlco2/codecarbon) in its offline mode.

The tracker starts when the run begins (before the data is read: preparing the tokens costs energy
too) and stops when it ends, however it ends. ``summary.json`` gets ``energy_kwh`` (CPU, RAM and GPU
energy, kWh), ``emissions_kg_co2`` (kg CO₂-equivalent) and ``emissions_country``; codecarbon's own
record of the run, power by device included, is ``emissions.csv`` in the run folder.

Offline means the grid's carbon intensity comes from codecarbon's bundled data for the country (and
for US states, Canadian provinces, Chinese provinces and Nordic bidding zones, the ``region``) given
here, not from a geolocation of this machine's IP address. Nothing is sent anywhere: the CodeCarbon
API, HTTP endpoints, Prometheus, Logfire and Electricity Maps are all pinned off, whatever a
``.codecarbon.config`` or a ``CODECARBON_*`` variable says (those still set the rest, a PUE for
instance).

Only the main process measures, in codecarbon's ``process`` mode: its CPU load and memory, with
those of its child processes (data-loader workers, the ranks it spawned; not ranks that a launcher
such as torchrun started beside it, nor other nodes), and every GPU it can see, whoever uses them.
Where the CPU has no energy counter codecarbon can read (RAPL on Linux needs read access to
``/sys/class/powercap``; containers and VMs seldom give it), CPU power is an estimate: the TDP of the
CPU model (from codecarbon's table, a default for a model it does not know) times this process's
share of the load. Where it has one, the counter is the whole package's, other jobs included. RAM
power is codecarbon's rule of thumb by memory in use. Treat the figures as an order of magnitude.

Needs the ``emissions`` extra: ``pip install 'lmlab-monitors[emissions]'``. codecarbon is imported
only when a run uses this monitor.
"""

import importlib.util
import logging
import re
from typing import Any

from pydantic import field_validator

from lmlab.api import Field, Monitor, Options, UserError, hookimpl

#: The countries whose ``region`` codecarbon looks up (others use the national figure only).
REGIONAL = ("USA", "CAN", "CHN", "SWE", "NOR", "FIN")
ISO3 = re.compile(r"[A-Z]{3}")


class EmissionsOptions(Options):
    country_iso_code: str = Field(
        "USA", help="ISO 3166-1 alpha-3 code of the country whose grid powers the machine (\"FRA\", \"DEU\"): "
                    "its carbon intensity converts kWh into kg CO2")
    region: str | None = Field(
        None, help="a US state, Canadian or Chinese province, or Nordic bidding zone (\"california\", "
                   "\"ontario\", \"SE3\") for a regional carbon intensity; unset: the country's")
    measure_power_secs: float = Field(
        15.0, gt=0, help="seconds between codecarbon's power readings (energy is integrated between them)")

    @field_validator("country_iso_code")
    @classmethod
    def _alpha3(cls, code: str) -> str:
        if not ISO3.fullmatch(code):
            raise ValueError(f"expected a 3-letter upper-case ISO 3166-1 alpha-3 code such as \"USA\" or "
                             f"\"FRA\", got {code!r}")
        return code


class Emissions(Monitor):
    """Energy (kWh) and emissions (kg CO2) of the run, from codecarbon, offline."""

    Options = EmissionsOptions
    api = ">=1.20,<2"  # RunControl.run; lmlab.api.monitor (1.7)

    def __init__(self, options=None):
        super().__init__(options)
        self.tracker = None  # the codecarbon tracker, on the main process while the run lasts

    def check(self, context) -> None:
        if importlib.util.find_spec("codecarbon") is None:
            raise UserError("the emissions monitor needs codecarbon: pip install 'lmlab-monitors[emissions]'",
                            key="monitor.use")
        o = self.options
        mix = _codecarbon_data("get_global_energy_mix_data")
        if mix is not None and o.country_iso_code not in mix:
            # codecarbon would quietly fall back to the world average.
            raise UserError(f"codecarbon has no grid data for {o.country_iso_code!r}; use an ISO 3166-1 alpha-3 "
                            "code it knows (\"USA\", \"FRA\", \"DEU\", \"CHN\", ...)",
                            key="monitor.emissions.country_iso_code")
        if o.region is None:
            return
        if o.country_iso_code not in REGIONAL:
            # codecarbon would ignore the region and use the national figure without a word.
            raise UserError(f"codecarbon has regional data only for {', '.join(REGIONAL)}, not for "
                            f"{o.country_iso_code}; leave region out", key="monitor.emissions.region")
        known = None
        if o.country_iso_code == "USA":
            known = _codecarbon_data("get_country_emissions_data", "usa")
        elif o.country_iso_code == "CAN":
            known = _codecarbon_data("get_country_energy_mix_data", "can")
        if known is not None and o.region.lower() not in known:
            names = sorted(k for k in known if not k.startswith("_"))
            raise UserError(f"codecarbon has no data for region {o.region!r} of {o.country_iso_code}; one of "
                            f"{', '.join(names)}", key="monitor.emissions.region")

    @hookimpl
    def lmlab_run_start(self, control):
        if not control.is_main:  # one measurement per run: the main process's (children included)
            return
        try:
            self.tracker = self._start(control)
        except Exception as exc:  # noqa: BLE001 - a meter that cannot start must not stop the training
            control.note(f"emissions: codecarbon did not start ({type(exc).__name__}: {exc}); "
                         "the run goes on without an emissions record")

    def _start(self, control):
        from codecarbon import OfflineEmissionsTracker, OutputMethod

        o = self.options
        control.run_dir.mkdir(parents=True, exist_ok=True)  # the core makes it later, once data is ready
        # codecarbon logs its set-up at INFO before it applies log_level: quiet it from the start.
        logging.getLogger("codecarbon").setLevel(logging.ERROR)
        tracker = OfflineEmissionsTracker(
            country_iso_code=o.country_iso_code, region=o.region,
            # Pinned, so that no config file or CODECARBON_* variable can send data anywhere:
            output_methods=[OutputMethod.CSV],  # emissions.csv only (no API, Prometheus, Logfire)
            emissions_endpoint=None, output_handlers=[],
            electricitymaps_api_token="",  # "" and not None: None would fall back to a configured token
            cloud_provider=None, cloud_region=None, country_2letter_iso_code=None,
            output_dir=str(control.run_dir), output_file="emissions.csv", on_csv_write="append",
            project_name=control.run.experiment,
            measure_power_secs=o.measure_power_secs, tracking_mode="process", log_level="error",
            # codecarbon's single-instance lock is a file in $TMPDIR and SIGINT/SIGTERM handlers that
            # would replace lmlab's own: runs in one process (a sweep, the tests) each have a tracker.
            allow_multiple_runs=True,
        )
        tracker.start()
        return tracker

    @hookimpl
    def lmlab_run_end(self, control) -> dict[str, Any] | None:
        tracker, self.tracker = self.tracker, None
        if tracker is None:
            return None
        try:
            tracker.stop()
            data = getattr(tracker, "final_emissions_data", None)
        except Exception as exc:  # noqa: BLE001 - raising here would lose every monitor's summary keys
            control.note(f"emissions: codecarbon failed to stop ({type(exc).__name__}: {exc})")
            return None
        if data is None:  # codecarbon swallows its own start-up errors, and then has nothing
            control.note("emissions: codecarbon recorded nothing (see its messages above)")
            return None
        out = {"energy_kwh": float(data.energy_consumed), "emissions_kg_co2": float(data.emissions),
               "emissions_country": self.options.country_iso_code}
        if self.options.region is not None:
            out["emissions_region"] = self.options.region
        return out


def _codecarbon_data(method: str, *args) -> dict | None:
    """One of codecarbon's bundled tables (``codecarbon.input.DataSource().<method>(*args)``), or None
    when this version of codecarbon cannot give it: the check then leaves the value to codecarbon."""
    try:
        from codecarbon.input import DataSource

        return getattr(DataSource(), method)(*args)
    except Exception:  # noqa: BLE001 - a check that cannot be made is skipped, not failed
        return None
