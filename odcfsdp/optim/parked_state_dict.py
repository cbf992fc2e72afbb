"""A parked optimizer's ``state_dict()`` and ``load_state_dict()`` ([parking]): what they read and hand over while
the state waits on the host."""

from __future__ import annotations

import torch

from ..torch_private import local_of
from .parked_host import host_value


class StateDictHooks:
    """The optimizer's state-dict hooks for a ``ParkedOptimizerState`` (``parking``): ``state_dict()`` hands out
    copies of the host values and the state stays parked; ``load_state_dict()`` brings the old state back first,
    then parks what it loaded."""

    def __init__(self, parking):
        self.parking = parking
        self._loaded: set[int] = set()  # storages of the tensors handed to load_state_dict

    def register(self, optimizer: torch.optim.Optimizer) -> list:
        """Register the three hooks; their handles."""
        return [optimizer.register_state_dict_post_hook(lambda _opt, sd: self.copies_in(sd)),
                optimizer.register_load_state_dict_pre_hook(self.before_load),
                optimizer.register_load_state_dict_post_hook(lambda *_: self.after_load())]

    def copies_in(self, state_dict: dict) -> dict:
        """``state_dict()`` hands out the optimizer's own per-parameter dicts: parked tensors are swapped for copies
        of their host values in new dicts, and the state stays parked."""
        if not self.parking.away:
            return state_dict
        for index, state in list(state_dict["state"].items()):
            state_dict["state"][index] = {key: host_value(value, self.parking.host_copy(value))
                                          if torch.is_tensor(value) else value for key, value in state.items()}
        return state_dict

    def before_load(self, _optimizer, state_dict: dict) -> None:
        """``load_state_dict`` replaces the tensors: the old ones come back first, nothing is left half-parked."""
        self.parking.unpark()
        self._loaded = set() if self.parking.owns_loads else {
            local_of(v).untyped_storage().data_ptr() for state in state_dict.get("state", {}).values()
            for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0}

    def after_load(self) -> None:
        """Park what was loaded. torch keeps a loaded tensor that is already on the parameter's device and dtype as
        it is: parking would empty the caller's tensor (another optimizer's state, a dict read again). Such tensors
        are copied first; odcfsdp's checkpoints hand over dicts of their own (``owned_loads``) and skip the copy."""
        for state in self.parking.optimizer.state.values():
            for key, value in list(state.items()):
                if (isinstance(value, torch.Tensor) and value.dim() > 0
                        and local_of(value).untyped_storage().data_ptr() in self._loaded):
                    state[key] = value.clone()
        self._loaded = set()
        self.parking.park()
