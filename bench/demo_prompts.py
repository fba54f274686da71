"""`make run`'s chat prompts (scripts/run_demo.py), which `--suite multiturn` runs too."""

SYSTEM = "You are a helpful coding assistant."
SUMMARY_SOURCE = (
    "The draft model proposes several tokens, and the target model checks all of them in one forward "
    "pass. Accepted tokens are kept; the first rejected token is replaced with a sample from the "
    "residual distribution, so the output has exactly the target model's distribution. Because the "
    "target is memory-bound, scoring five tokens costs about as much as scoring one."
)
QUESTIONS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a Python list comprehension is, with one short example.",
    f"Summarise in two sentences:\n\n{SUMMARY_SOURCE}",
]
