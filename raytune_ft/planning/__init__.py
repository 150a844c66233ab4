"""Planning: model shapes, GPU specs and FLOPs, the memory plan, the LoRA lines, the disk a run needs, the projection."""
