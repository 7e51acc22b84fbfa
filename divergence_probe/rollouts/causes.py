"""What a recording far from both stacks likely means: score's flag (`likely_cause` in summary.csv), named where the
CLI, the report and score itself read it. Plain data, no torch: rendering a report imports none."""

CAUSES = {
    "temperature": "the recorded logprobs match the trainer's at another temperature than the one compared "
                   "(fitted_temperature, or the raw logprobs when --temperature was given): one side applies the "
                   "sampling temperature and the other does not; score again with the run's --temperature",
    "wrong_tokens": "most of the gap is on tokens the model would hardly sample: the recorded ids are not the "
                    "tokens the logprobs belong to (an offset, a tokenizer or a padding mix-up)",
    "stale_weights": "neither a temperature nor unlikely tokens explain the gap: the rollouts likely came from other "
                     "weights than these (stale weights in the engine, or another checkpoint)",
}
