from anyfit.cli import run

run()
