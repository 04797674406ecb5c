"""MOPD algorithm core: targets, losses, token log-probs, routing, plan, phases, compatibility.

See DESIGN.md §3 for the formulas and their sources; each module's docstring gives its own. Import from the
module that defines a name (`from mopd_hpc.mopd.targets import aggregate_teacher_targets`): this package imports
nothing, so a light user of one module (launch/model_check.py's `compatibility`) does not import torch.
"""
