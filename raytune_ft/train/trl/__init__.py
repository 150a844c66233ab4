"""The TRL loop: a `trl.SFTTrainer` inside each Ray Train worker, fed from the project's Ray Data pipeline.

    base.py        names every part shares (file names, schedule names, the fault-injection variable,
                   train-state files, reporting to Ray); imports no sibling
    data.py        this rank's blocks as the trainer's dataset, and the one-row facade TRL inspects
    checkpoint.py  staging a Hugging Face save as the project's checkpoint, restore, meta, final export
    trainer.py     the SFTTrainer subclass and the callback that logs and reports to Ray Train
    loop.py        `train_trl`, the worker entry point: reads top to bottom like `train_fsdp`

The entry sits on top: no part imports `loop`.
"""
