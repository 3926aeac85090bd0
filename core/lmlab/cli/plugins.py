"""``lmlab plugins [SLOT] [--check]``: the installed plugins per slot, each that cannot load marked with
why. Listing imports no plugin module (lmlab.plugin_health reads their source and the failures recorded
when they were last imported); ``--check`` imports them all and runs the loader's checks."""

from lmlab import discovery, plugin_health
from lmlab.errors import UserError, did_you_mean


def add_arguments(parser) -> None:
    parser.add_argument("slot", nargs="?", help="only this slot")
    parser.add_argument("--check", action="store_true",
                        help="import every plugin and check it as a run would (slow); exit 1 if any fails")


def main(args) -> int:
    if args.slot and args.slot not in discovery.ALL_SLOTS:
        raise UserError(f"unknown slot{did_you_mean(args.slot, discovery.ALL_SLOTS)}; "
                        f"slots: {', '.join(discovery.ALL_SLOTS)}", key=args.slot)
    found = discovery.installed()
    slots = [args.slot] if args.slot else [s for s in discovery.ALL_SLOTS if found.get(s)] + sorted(
        s for s in found if s not in discovery.ALL_SLOTS and found[s])
    if args.check:
        return _check([p for slot in slots if slot in discovery.ALL_SLOTS for p in found.get(slot, [])])
    everything = [p for plugins in found.values() for p in plugins]
    problems = plugin_health.problems([p for slot in slots for p in found.get(slot, [])], everything)
    for slot in slots:
        plugins = found.get(slot, [])
        print(f"{slot}:")
        names = [p.name for p in plugins]
        for p in plugins:
            clash = "  ! also declared by another distribution" if names.count(p.name) > 1 else ""
            unknown = "  ! not a known slot; lmlab ignores it" if slot not in discovery.ALL_SLOTS else ""
            problem = f"  ! {problems[p]}" if p in problems else ""
            print(f"  {p.name:<16} {p.distribution} {p.version}{clash}{unknown}{problem}")
        missing = [e for e in discovery.catalogue() if e.get("slot") == slot and e.get("name") not in names]
        for entry in missing:
            print(f"  {entry['name']:<16} (not installed: pip install {entry['distribution']}) "
                  f"{entry.get('summary', '')}")
        if not plugins and not missing:
            print("  (none)")
    return 0


def _check(plugins) -> int:
    failed = 0
    for info in plugins:
        try:
            discovery.load_plugin(info, key=f"{info.slot}.use")
        except UserError as exc:
            failed += 1
            print(f"{info.slot}: {' '.join(exc.message.split())}", flush=True)  # pluggy's run over lines
    print(f"{len(plugins) - failed} of {len(plugins)} plugins load and pass their checks"
          + (f"; {failed} fail" if failed else ""))
    return 1 if failed else 0
