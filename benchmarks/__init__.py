"""Side-by-side benchmarks (loragen vs peft vs the frozen base); see BENCHMARKS.md."""
