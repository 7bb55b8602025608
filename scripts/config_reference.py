"""Print docs/config.md, the config reference, made from the config's dataclasses
(components/config/schema.py: each key's type, default, allowed values and docstring).

    python3 -m scripts.config_reference > docs/config.md

tests/test_config.py fails when docs/config.md differs from what this prints."""

import argparse
import sys

if not __package__:  # run as a file: the repository root (components) is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.config_reference ...")

from components.config.docs import reference_markdown  # noqa: E402


def main(argv=None) -> None:
    argparse.ArgumentParser(prog="python3 -m scripts.config_reference", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    sys.stdout.write(reference_markdown())


if __name__ == "__main__":
    main()
