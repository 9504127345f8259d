"""torchrun reads its own options only up to the training script: a backport of the fix proposed
for pytorch issue #120601 ("Torchrun arguments shadowing script arguments", open) in pytorch
PR #196064 (open), installed as a startup hook.

torchrun's argparse parser (allow_abbrev on, the script's arguments a REMAINDER) classifies every
token of the command line, the script's included, as one of its own options where it can, so

    torchrun train/mtpc.py --arch btree --n 16

exits with "ambiguous option: --n could match --nnodes, --nproc-per-node, ..." before the script
runs. The hook wraps the module-level `parse_args(args)` of `torch.distributed.run` (what the
`torchrun` console script and `from torch.distributed.run import main` call): the leading tokens
up to the training script are resolved against the parser's own options (`_option_string_actions`:
an exact option string, or a long-option prefix whose every match belongs to one action (so
`--nproc 2` is --nproc-per-node, which Python 3.11's argparse refuses as ambiguous between its two
spellings), `--opt=value`, a short option with its value attached or next, options of nargs=0
(--standalone, -m, --no-python, ...) taking no value); the first token that is not an option is
the script, and it and every token after it go to `training_script` / `training_script_args`
untouched. A leading token it cannot resolve (an unknown or ambiguous option, -h, `--`, an option
missing its value) hands the whole command line to the original parse_args, so every other
command behaves, and fails, as before.

Installed by `make install` (the Makefile's install step), or into any environment with

    python -m mtpkit.train.torchrun_args --install      # --uninstall removes it

which writes `mtpkit_torchrun_args.pth` into that environment's site-packages; its one line adds a
`sys.meta_path` finder (`install`) that does nothing until `torch.distributed.run` is imported
(this module imports only the standard library; a Python start-up costs a few microseconds more).
Not covered: `python -m torch.distributed.run ...`, which runs the module's code as `__main__`
before any hook can wrap it; use the `torchrun` command there, or `-n`/`--window` for MTPC's window.
"""

from __future__ import annotations

import sys

# argparse, sysconfig and pathlib are imported where used: this module is imported at every start-up

MODULE = "torch.distributed.run"
PTH_NAME = "mtpkit_torchrun_args.pth"
PTH_LINE = ('import sys; exec("try:\\n import mtpkit.train.torchrun_args\\nexcept ImportError:\\n pass\\nelse:\\n'
            ' sys.modules.pop(\'mtpkit.train.torchrun_args\').install()")\n')
"""the .pth line (site runs lines that start with `import`): a missing mtpkit is no error at start-up,
and the module is left out of sys.modules, so `python -m mtpkit.train.torchrun_args` later runs
without runpy's "found in sys.modules" warning"""


def split_args(argv: list[str], parser) -> tuple[list[str], list[str]] | None:
    """(torchrun's tokens, [script, *script args]) for `argv`, or None where a token before the
    script cannot be resolved (see the module docstring). torchrun's tokens come back with each
    option spelled out in full (an abbreviation replaced by the action's first long spelling), so
    the original parser reads them without guessing."""
    import argparse

    actions = parser._option_string_actions
    launcher, i = [], 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-") or token == "-":
            return launcher, list(argv[i:])
        if token == "--":
            return None
        name, joined, value = token.partition("=") if token.startswith("--") else (token, "", "")
        attached = ""
        if not token.startswith("--") and len(token) > 2:  # -r3: a short option with its value attached
            name, attached = token[:2], token[2:]
        action = _resolve(name, actions)
        if action is None or isinstance(action, argparse._HelpAction):
            return None
        spelled = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
        takes_value = action.nargs != 0
        if not takes_value:
            if joined or attached:
                return None
            launcher.append(spelled)
            i += 1
        elif joined or attached:
            launcher.append(f"{spelled}={value if joined else attached}")
            i += 1
        elif i + 1 < len(argv):
            launcher += [spelled, argv[i + 1]]
            i += 2
        else:
            return None
    return None  # no training script: the original parser says what is missing


def _resolve(name: str, actions: dict):
    """The action of option string `name`: exact, or (a long option) a prefix whose matches all
    belong to one action."""
    if name in actions:
        return actions[name]
    if not name.startswith("--") or len(name) < 3:
        return None
    matches = {id(a): a for option, a in actions.items() if option.startswith(name)}
    return next(iter(matches.values())) if len(matches) == 1 else None


def wrap_parse_args(original, get_args_parser):
    """`parse_args(args)` of torch.distributed.run that reads torchrun's options only before the
    script (`original` where `split_args` cannot tell)."""

    def parse_args(args=None):
        argv = sys.argv[1:] if args is None else list(args)
        split = split_args(argv, get_args_parser())
        if split is None:
            return original(args)
        launcher, (script, *script_args) = split
        parsed = original([*launcher, script])
        parsed.training_script_args = script_args
        return parsed

    parse_args.__wrapped__ = original
    parse_args.__doc__ = original.__doc__
    return parse_args


def patch(module) -> None:
    """Wrap `module.parse_args` (torch.distributed.run) once."""
    if not hasattr(module.parse_args, "__wrapped__"):
        module.parse_args = wrap_parse_args(module.parse_args, module.get_args_parser)


class _PatchingLoader:
    """The real loader of torch.distributed.run; the module is patched right after it runs."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        patch(module)

    def __getattr__(self, name):  # get_code, get_source, ... (runpy, linecache)
        return getattr(self.loader, name)


class _Finder:
    """A sys.meta_path entry that answers only for torch.distributed.run: the spec the other
    finders give, its loader wrapped by `_PatchingLoader`. Recognised by `mtpkit_torchrun_args`
    rather than by class: the .pth may run twice, each time with its own copy of this module."""

    mtpkit_torchrun_args = True
    busy = False  # a finder below that looks the name up again (importlib.util.find_spec) gets None here

    def find_spec(self, name, path=None, target=None):
        if name != MODULE or self.busy:
            return None
        self.busy = True
        try:
            for finder in sys.meta_path:
                if getattr(finder, "mtpkit_torchrun_args", False) or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _PatchingLoader(spec.loader)
                    return spec
            return None
        finally:
            self.busy = False


def install() -> None:
    """Put the finder first on sys.meta_path (once); an already imported torch.distributed.run is
    patched now."""
    if MODULE in sys.modules:
        patch(sys.modules[MODULE])
    if not any(getattr(f, "mtpkit_torchrun_args", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def site_packages():
    """This environment's site-packages (where pip installs pure-Python packages), a Path."""
    import sysconfig
    from pathlib import Path

    return Path(sysconfig.get_paths()["purelib"])


def main(argv=None) -> int:
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m mtpkit.train.torchrun_args",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--install", action="store_true", help=f"write {PTH_NAME} into site-packages")
    what.add_argument("--uninstall", action="store_true", help=f"remove {PTH_NAME} from site-packages")
    p.add_argument("--site-packages", type=Path, default=None, help="the folder (default: this environment's)")
    args = p.parse_args(argv)
    pth = (args.site_packages or site_packages()) / PTH_NAME
    if args.install:
        pth.write_text(PTH_LINE)
        print(f"wrote {pth}")
    elif pth.exists():
        pth.unlink()
        print(f"removed {pth}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
