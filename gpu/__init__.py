"""What a run does differently on a CUDA GPU, chosen for the user unless a setting says otherwise:
the fast sampler (auto.py: static KV cache with torch.compile, merged LoRA sampling), the memory
levers (memory.py: micro-batch size, gradient checkpointing, from an estimate of the peak) and
a decode attention that reads grouped K/V without copying it (attention.py). On a CPU nothing here
runs: the settings stay as written."""
