"""``lmlab new-plugin NAME --slot SLOT [--dir DIR]``: scaffolds a third-party plugin distribution.

Writes DIR/lmlab-NAME: pyproject.toml (the entry point), the plugin (a small working implementation
of the slot), its tests (the conformance kit), a README and an example manifest. Imports no torch
unless the slot has no template of its own.
"""

import sys

from lmlab import discovery


def add_arguments(parser) -> None:
    parser.add_argument("name", metavar="NAME", help="the plugin's name, which manifests write in `use`: lowercase letters, "
                                     "digits and dashes (the distribution becomes lmlab-NAME)")
    parser.add_argument("--slot", required=True, metavar="SLOT",
                        help=f"the slot it fills: {', '.join(discovery.ALL_SLOTS)}")
    parser.add_argument("--dir", default=".", metavar="DIR",
                        help="where to create lmlab-NAME/ (default: the current folder)")


def main(args) -> int:
    from lmlab import scaffold

    target, plan = scaffold.create(args.name, args.slot, args.dir)
    for dist in scaffold.name_clashes(plan):
        print(f"lmlab: warning: {dist} already provides the {plan.slot} plugin {plan.name!r}; with both installed "
              "lmlab refuses the name, so pick another (the entry point in pyproject.toml)", file=sys.stderr)
    print(f"created {target}: {plan.slot} plugin {plan.name!r}, class {plan.cls} in "
          f"src/{plan.package}/{plan.module}.py")
    print("next:")
    print(f"  cd {target}")
    print("  pip install -e '.[test]'     # into the environment where lmlab is installed")
    print("  pytest                       # lmlab's contract checks of the slot, and the plugin's own tests")
    print("  lmlab run example.toml       # trains a tiny model with it, in seconds")
    return 0
