"""SpecConsole's entry point (its options: specconsole.cli; what each command does: specconsole.commands).

    python launch.py                       the console in the browser (http://127.0.0.1:7860)
    python launch.py demo --prompt "..."   one prompt on both engines in the terminal, with the comparison
    python launch.py demo --prompt "..." --compare draft,ngram,draft:k=4   the baseline and up to four speculative
                                           configurations, then a table of them all
    python launch.py suite --category code --sweep k   prompt suites on both engines: CSV, verdicts, advice
    python launch.py replay RUN_ID --out replay.html   a saved run as a self-contained HTML replay (offline)

`specconsole` (installed with the project) is the same command. `launch.py SUBCOMMAND --help` lists its options.
"""

from __future__ import annotations

import logging
import os
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

log = logging.getLogger("specconsole")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from specconsole import commands
    from specconsole.cli import COMMANDS, parsers

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:  # options alone (or none, or --help): the console's
        argv = ["console", *argv]
    p, parser_of = parsers(__doc__)
    args, unknown = p.parse_known_args(argv)
    if unknown:  # said by the subcommand's parser, with its usage, as when it parses alone
        parser_of[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    from engine.exact.models import ModelError
    from engine.limits import SettingsError
    from engine.setup import setup

    setup()  # process-wide settings (warning filters, httpx log redaction, the rowwise attention): engine.setup
    try:
        return getattr(commands, args.command)(args)
    except (ModelError, SettingsError) as e:
        log.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
