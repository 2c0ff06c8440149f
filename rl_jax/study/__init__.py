"""Studies: named grids of RL runs over seeds (`studies`), run and aggregated by `runner`; CLI in __main__."""
