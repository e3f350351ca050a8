"""A custom tool for mlx-grpo: count the words of a text.

    mlx-grpo train --config configs/arith_tools.toml \
        --set 'tools=["calculator","examples/tools/word_count.py:word_count"]'

A tool is a plain function: every parameter has a type hint and the docstring has a summary line and an
`Args:` entry per parameter (transformers' get_json_schema reads both into the JSON schema the model is
shown). What it returns reaches the model as text; an exception comes back as "Error: ...".
"""


def word_count(text: str) -> int:
    """Count the words in a text (runs of characters between whitespace).

    Args:
        text: The text whose words to count.
    """
    return len(text.split())
