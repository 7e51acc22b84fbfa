"""The runs: compare, ablate, score, their capture and noise floors, rerun and history."""
