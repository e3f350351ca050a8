"""Vision-language models through mlx-vlm: conversion, image + text generation and chat, image data sets,
the offline `shapes` task, and GRPO on image + text prompts (rollouts and the training forward that share
each prompt's vision features among its samples). Needs the `vlm` extra (mlx-vlm)."""
