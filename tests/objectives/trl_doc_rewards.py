"""TRL's documented example reward functions, as data: the functions' text is copied unchanged from TRL's GRPO
Trainer documentation (docs/source/grpo_trainer.md, "Quick start" and "Using a custom reward function", Examples
1-6, TRL 1.x), so titanium is checked against the contract TRL documents (tests/unit/test_trl_doc_rewards.py).
The two helpers Example 4 leaves to the reader (``check_math_solution``, ``test_code_solution``) are defined
here; nothing else is titanium's."""

# ruff: noqa
import asyncio
import re


# Quick start
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


# Example 1: Reward longer completions (its parameter is spelled completions_ids; TRL passes completion_ids)
def reward_func_tokens(completions_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completions_ids]


# Example 1.1: Reward longer completions (based in the number of characters)
def reward_func_characters(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion)) for completion in completions]


# Example 2: Reward completions with specific format
def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


# Example 3: Reward completions based on a reference
def reward_func_ground_truth(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


# Example 4: Multi-task reward functions
def check_math_solution(prompt, completion):  # (the reader's, in TRL's example)
    return "4" in completion or "12" in completion


def test_code_solution(prompt, completion):  # (the reader's, in TRL's example)
    return "return" in completion


# Math-specific reward function
def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards


# Coding-specific reward function
def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "coding":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards


# Example 5: Asynchronous reward functions
async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]


# Example 6: Logging extra columns and metrics
def reward_func_logging(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    extracted = [m.group(1) if m else None for m in extracted]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]

    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [e or "[none]" for e in extracted])

    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))

    return rewards
