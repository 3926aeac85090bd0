"""``lmlab plugins [SLOT]``: reads entry-point metadata only; imports no plugin module."""

from lmlab import discovery
from lmlab.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("slot", nargs="?", help="only this slot")


def main(args) -> int:
    if args.slot and args.slot not in discovery.SLOTS:
        raise UserError(f"unknown slot{discovery.did_you_mean(args.slot, discovery.SLOTS)}; "
                        f"slots: {', '.join(discovery.SLOTS)}", key=args.slot)
    found = discovery.installed()
    slots = [args.slot] if args.slot else [s for s in discovery.SLOTS if found.get(s)] + sorted(
        s for s in found if s not in discovery.SLOTS and found[s])
    for slot in slots:
        plugins = found.get(slot, [])
        print(f"{slot}:")
        names = [p.name for p in plugins]
        for p in plugins:
            clash = "  ! also declared by another distribution" if names.count(p.name) > 1 else ""
            unknown = "  ! not a known slot; lmlab ignores it" if slot not in discovery.SLOTS else ""
            print(f"  {p.name:<16} {p.distribution} {p.version}{clash}{unknown}")
        missing = [e for e in discovery.catalogue() if e.get("slot") == slot and e.get("name") not in names]
        for entry in missing:
            print(f"  {entry['name']:<16} (not installed: pip install {entry['distribution']}) "
                  f"{entry.get('summary', '')}")
        if not plugins and not missing:
            print("  (none)")
    return 0
