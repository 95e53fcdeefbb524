"""RULER (Hsieh et al., 2024): 13 synthetic long-context tasks generated at any length in the model's own tokens.

``templates`` holds each subtask's definition (haystack, needles, wording, answer prefix, tokens to generate),
``haystacks`` the filler texts and word lists, ``generators`` one function per kind of subtask, ``qa`` the SQuAD
and HotpotQA rows, ``fit`` the search for the largest haystack within the asked length, and ``task`` the task.
"""
