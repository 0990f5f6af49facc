"""Commands run around training, from the repository root as modules:

    python -m tools.precompute --config configs/grubrics.yaml ...  # answers, gold scores (pre-GRPO)
    python -m tools.export --config configs/quickstart.yaml --adapter runs/quickstart --out exported
    python -m tools.bestofn runs/eval/predictions_trained.jsonl --sft best.jsonl  # best-of-n SFT
    python -m tools.plots runs/a runs/b                            # training curves, a line per run
    python -m tools.explain --config configs/quickstart.yaml       # one step, quantity by quantity
    python -m tools.ratings serve --dir runs/qgen_human/ratings    # the page people rate on
"""
