"""Running `oda` in-process for tests of its user errors."""

from oda_hf.cli import main


def run_oda(argv, capsys):
    """`oda argv` in-process: (exit status, stderr). argparse errors exit through SystemExit."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit:
        code = exit.code
    return code, capsys.readouterr().err
