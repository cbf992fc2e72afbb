"""Samples, and packing several samples into one micro-batch row.

Packed documents are concatenated into one row with per-document positions
(restarting at 0) and document ids; the model masks attention so that no token
attends across documents (``odcfsdp.models.llama.document_mask``). Targets are the
next token *within* a document, ``-100`` where the sample carries no loss
(prompts) and at each document's last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class Sample:
    """One training document.

    Attributes:
        index: position in its source (stable across runs).
        tokens: (n,) int64 token ids.
        loss_mask: (n,) bool, True where the token is a prediction target.
    """

    index: int
    tokens: torch.Tensor
    loss_mask: torch.Tensor

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.tokens.shape != self.loss_mask.shape:
            raise ValueError(f"sample {self.index}: tokens and loss_mask must be 1-D of equal length")
        if self.tokens.numel() < 2:
            raise ValueError(f"sample {self.index} has {self.tokens.numel()} tokens; at least 2 are needed")

    @property
    def n_inputs(self) -> int:
        """Positions this sample occupies in a micro-batch (its length minus one)."""
        return self.tokens.numel() - 1

    @property
    def n_targets(self) -> int:
        """Loss-bearing targets of this sample."""
        return int(self.loss_mask[1:].sum())

    def truncated(self, max_tokens: int) -> "Sample":
        """This sample cut to at most ``max_tokens`` tokens."""
        if self.tokens.numel() <= max_tokens:
            return self
        return Sample(self.index, self.tokens[:max_tokens], self.loss_mask[:max_tokens])


@dataclass
class MicroBatch:
    """One packed row (batch size 1) ready for the model; all tensors are (1, T)."""

    tokens: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    document_ids: torch.Tensor
    sample_indices: list[int]
    doc_lengths: list[int]  # positions of each packed document, in order (host-side: no device sync)

    @property
    def n_targets(self) -> int:
        return int((self.targets != IGNORE).sum())

    def to(self, device: torch.device | str) -> "MicroBatch":
        """The same micro-batch on ``device``.

        To a GPU through pinned memory, asynchronously: a copy from pageable memory
        first waits for all work queued on the stream, which would drain the GPU's
        queue at every micro-batch and leave it idle while the host launches the next.
        """
        device = torch.device(device)
        if device.type == "cuda":
            move = lambda t: t.pin_memory().to(device, non_blocking=True)  # noqa: E731
        else:
            move = lambda t: t.to(device)  # noqa: E731
        return MicroBatch(move(self.tokens), move(self.targets), move(self.positions), move(self.document_ids),
                          self.sample_indices, self.doc_lengths)


def empty_micro_batch() -> MicroBatch:
    """A one-position micro-batch with no target: keeps collectives matched when a rank has no work."""
    z = torch.zeros(1, 1, dtype=torch.long)
    return MicroBatch(z, torch.full_like(z, IGNORE), z.clone(), z.clone(), [], [1])


def pack(samples: list[Sample]) -> MicroBatch:
    """Concatenate ``samples`` into one row with per-document positions, ids and targets."""
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    tokens, targets, positions, doc_ids = [], [], [], []
    for k, s in enumerate(samples):
        n = s.n_inputs
        tokens.append(s.tokens[:-1])
        targets.append(torch.where(s.loss_mask[1:], s.tokens[1:], torch.full_like(s.tokens[1:], IGNORE)))
        positions.append(torch.arange(n))
        doc_ids.append(torch.full((n,), k))
    return MicroBatch(
        torch.cat(tokens)[None], torch.cat(targets)[None], torch.cat(positions)[None], torch.cat(doc_ids)[None],
        [s.index for s in samples], [s.n_inputs for s in samples],
    )
