"""The numbers: tap metrics, routing counts, Shapley shares, noise verdicts, reductions."""
