"""Run grids, their one home: `sweeps` (flat one-seed grids and the override vocabulary), `studies` (panels x lines x seeds), run and aggregated by `runner`; CLI in __main__."""
