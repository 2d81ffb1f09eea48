"""Where a multimodal model's encoders should run: the step each placement gives, and the best one.

[Note: the placement's cost model]
Every worker ``w`` (a CPU worker or a device's process, by place: ``cpu0``, ``device1``) computes
``n_w`` samples of each batch; a fraction ``p_m`` of the samples carries modality ``m``, so ``w``'s
share holds ``n_w p_m`` of them. An encoder ``m`` costs ``f[m][w]`` seconds per sample forward and
``b[m][w]`` backward on ``w``; the rest of the model (fusion, backbone, loss) ``k[w]`` per sample,
forward and backward; an encoder's output costs ``t[m]`` seconds per sample to send from one
process to another (its gradient as much back). A placement puts each encoder on one place (that
process computes it for every share) or leaves it ``split`` (every worker its own share's). One
step, as ``multimodal.py`` runs it:

1. each host first encodes the other workers' shares: ``A_h = sum over m placed on h, w != h of
   n_w p_m f[m][h]``;
2. each worker then runs its own step: its local encoders (split ones and those placed on it)
   forward, ``L_w``; the outputs of encoders placed elsewhere are ready at ``R_w = max over them of
   A_host + l + n_w p_m t[m]`` (``l``: a message's latency); then the backbone and the local encoders' backward,
   ``K_w = n_w k[w] + sum over local m of n_w p_m b[m][w]``: its own step ends at
   ``D_w = max(A_w + L_w, R_w) + K_w``;
3. each host then runs its encoders' backward for the others, once their gradients are back:
   it starts at ``max(D_h, max over its consumers of D_w + l + n_w p_m t[m])`` and takes
   ``sum of n_w p_m b[m][h]``.

The step ends when the last worker does (the gradient sum after it is the same for every
placement, and left out). Within a worker the model's ``forward`` may call the encoders in any
order; the model takes the local ones first, the best case for hiding a remote encoder's wait.
The search tries every placement (each encoder split or on any place) and keeps the fastest; a
tie keeps the one with fewer placed encoders (less to send).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Union

from lightning_hetero.files import atomic_write
from lightning_hetero.multimodal import SPLIT
from lightning_hetero.profiling import EncoderTimes, LinkProfile
from lightning_hetero.shares import split_batch

__all__ = [
    "EncoderCosts",
    "EncoderProfile",
    "PlacementPrediction",
    "predict_placement",
    "best_placement",
    "ranked_placements",
    "samples_by_place",
    "explain_placement",
]


@dataclass(frozen=True, kw_only=True)
class EncoderCosts:
    """What a multimodal model costs on one machine's processes, per sample (see the module's note)."""

    forward: Mapping[str, Mapping[str, float]]
    """Seconds per sample carrying the modality, by modality, then place: an encoder's forward."""
    backward: Mapping[str, Mapping[str, float]]
    """The same for the encoder's backward."""
    backbone: Mapping[str, float]
    """Seconds per sample by place: the rest of the model, forward and backward."""
    transfer: Mapping[str, float] = field(default_factory=dict)
    """Seconds per sample to send an encoder's output (or its gradient) between two processes, by modality."""
    latency: float = 0.0
    """Seconds per message between two processes, whatever its size (an output, a gradient)."""

    @property
    def places(self) -> list[str]:
        return list(self.backbone)

    @property
    def modalities(self) -> list[str]:
        return list(self.forward)


@dataclass(frozen=True)
class PlacementPrediction:
    """The step a placement gives: when each worker finishes, and the step (the last of them)."""

    placement: dict[str, str]
    finish_s: dict[str, float]
    """Each place's end of the step: its own share and the encoders it computes for others."""

    @property
    def step_s(self) -> float:
        return max(self.finish_s.values())


def predict_placement(
    costs: EncoderCosts, samples: Mapping[str, float], carrying: Mapping[str, float], placement: Mapping[str, str]
) -> PlacementPrediction:
    """The step of ``placement`` (modality to place; missing or ``"split"``: every worker its own share)
    for ``samples`` per place and a fraction ``carrying[m]`` of the samples carrying each modality."""
    host = {m: placement.get(m, SPLIT) for m in costs.modalities}

    def count(w: str, m: str) -> float:
        return samples.get(w, 0.0) * carrying.get(m, 0.0)

    def send(w: str, m: str) -> float:
        return costs.latency + count(w, m) * costs.transfer.get(m, 0.0)

    def local(w: str) -> list[str]:
        return [m for m in costs.modalities if host[m] in (SPLIT, w)]

    def consumers(h: str, m: str) -> list[str]:
        return [w for w in costs.places if w != h and host[m] == h and count(w, m) > 0]

    hosting = {h: sum(count(w, m) * costs.forward[m][h] for m in costs.modalities for w in consumers(h, m)) for h in costs.places}
    own_end = {}
    for w in costs.places:
        if not samples.get(w, 0.0):
            own_end[w] = hosting[w]
            continue
        encode = sum(count(w, m) * costs.forward[m][w] for m in local(w))
        ready = max(
            (hosting[host[m]] + send(w, m) for m in costs.modalities if m not in local(w) and count(w, m)),
            default=0.0,
        )
        rest = samples[w] * costs.backbone[w] + sum(count(w, m) * costs.backward[m][w] for m in local(w))
        own_end[w] = max(hosting[w] + encode, ready) + rest
    finish = {}
    for h in costs.places:
        served = [(w, m) for m in costs.modalities for w in consumers(h, m)]
        if not served:
            finish[h] = own_end[h]
            continue
        back = max(own_end[w] + send(w, m) for w, m in served)
        finish[h] = max(own_end[h], back) + sum(count(w, m) * costs.backward[m][h] for w, m in served)
    return PlacementPrediction({m: h for m, h in host.items() if h != SPLIT}, finish)


def ranked_placements(
    costs: EncoderCosts,
    samples: Mapping[str, float],
    carrying: Mapping[str, float],
    places: Sequence[str] | None = None,
    split_only: Collection[str] = (),
) -> list[PlacementPrediction]:
    """Every placement of the encoders (each split or on one of ``places``, default every place of
    ``costs``; those of ``split_only``, which cannot be placed, split), fastest first; of equal
    steps, fewer placed encoders first."""
    options = [SPLIT, *(places if places is not None else costs.places)]
    per_modality = [[SPLIT] if m in split_only else options for m in costs.modalities]
    predictions = [
        predict_placement(costs, samples, carrying, dict(zip(costs.modalities, choice)))
        for choice in itertools.product(*per_modality)
    ]
    return sorted(predictions, key=lambda p: (round(p.step_s, 12), len(p.placement)))


def best_placement(
    costs: EncoderCosts,
    samples: Mapping[str, float],
    carrying: Mapping[str, float],
    places: Sequence[str] | None = None,
    split_only: Collection[str] = (),
) -> PlacementPrediction:
    """The fastest placement (``predict_placement``) of every encoder, split or on one of ``places``
    (default: every place of ``costs``), those of ``split_only`` split; of equal steps, the one with
    fewer placed encoders."""
    return ranked_placements(costs, samples, carrying, places, split_only)[0]


def samples_by_place(batch_size: int, cpu_fraction: float, cpu_workers: int, devices: int) -> dict[str, float]:
    """Each place's samples of a batch (``cpu0``, ..., ``device0``, ...) where the devices hold whole
    models (replicas, or one stage) and the CPU workers take ``cpu_fraction`` (``shares.py``)."""
    shares = split_batch(batch_size, cpu_fraction, cpu_workers, 1)
    samples = {f"cpu{i}": float(stop - start) for i, (start, stop) in enumerate(shares.cpu)}
    for j in range(devices):
        start, stop = shares.device_part(j, devices)
        samples[f"device{j}"] = float(stop - start)
    return samples


@dataclass
class EncoderProfile:
    """A multimodal model measured on every process of a run, by place (``WorkloadAnalyzer`` writes it
    as ``encoders.json``; ``hetero-plan`` reads it)."""

    batch_size: int
    places: dict[str, EncoderTimes]
    """Each process's costs, by place: ``cpu0``, ..., ``device0``, ..."""
    link: LinkProfile
    """Sending between two processes (an encoder's output, its gradient)."""
    split_only: list[str] = field(default_factory=list)
    """The modalities whose encoders cannot be placed (``multimodal.unplaceable_encoders``)."""

    @property
    def carrying(self) -> dict[str, float]:
        """The fraction of the profiled batch's samples carrying each modality."""
        return dict(next(iter(self.places.values())).carrying)

    def costs(self) -> EncoderCosts:
        first = next(iter(self.places.values()))
        return EncoderCosts(
            forward={m: {w: t.forward.get(m, 0.0) for w, t in self.places.items()} for m in first.forward},
            backward={m: {w: t.backward.get(m, 0.0) for w, t in self.places.items()} for m in first.forward},
            backbone={w: t.rest for w, t in self.places.items()},
            transfer={m: size / self.link.bytes_per_s for m, size in first.output_bytes.items()},
            latency=self.link.latency,
        )

    def on(self, gpus: int, gpu_speed: float = 1.0, cpu_workers: int = 1, cpu_speed: float = 1.0, link_gbps: Optional[float] = None) -> EncoderProfile:
        """The same model on a machine with ``gpus`` devices ``gpu_speed`` times as fast as the profiled
        ``device0`` and ``cpu_workers`` CPU workers ``cpu_speed`` times as fast as ``cpu0``."""
        for place in ("device0", "cpu0") if cpu_workers else ("device0",):
            if place not in self.places:
                raise ValueError(f"The encoder profile has no timings of {place!r}; profile a run that has one.")

        def scaled(times: EncoderTimes, speed: float) -> EncoderTimes:
            return replace(
                times,
                forward={m: t / speed for m, t in times.forward.items()},
                backward={m: t / speed for m, t in times.backward.items()},
                rest=times.rest / speed,
            )

        places = {f"cpu{i}": scaled(self.places["cpu0"], cpu_speed) for i in range(cpu_workers)}
        places.update({f"device{j}": scaled(self.places["device0"], gpu_speed) for j in range(gpus)})
        link = self.link if link_gbps is None else LinkProfile(self.link.latency, link_gbps * 1e9)
        return EncoderProfile(self.batch_size, places, link, list(self.split_only))

    def save(self, path: Union[str, Path]) -> Path:
        with atomic_write(path, "w") as f:
            f.write(json.dumps(asdict(self), indent=1))
        return Path(path)

    @classmethod
    def load(cls, path: Union[str, Path]) -> EncoderProfile:
        try:
            raw: dict[str, Any] = json.loads(Path(path).read_text())
            places = {name: EncoderTimes(**times) for name, times in raw["places"].items()}
            return cls(raw["batch_size"], places, LinkProfile(**raw["link"]), list(raw.get("split_only", [])))
        except (KeyError, TypeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path} is not an encoder profile written by WorkloadAnalyzer ({error!r}).") from error


def explain_placement(profile: EncoderProfile, samples: Mapping[str, float], shown: int = 5) -> str:
    """The encoders' measured costs by place, and the fastest placements with their predicted steps."""
    costs, carrying = profile.costs(), profile.carrying
    places = costs.places
    rows = ["Encoders: forward + backward per sample carrying the modality, by place (ms)"]
    width = max(len(m) for m in [*costs.modalities, "rest of the step"]) + 2
    rows.append(f"{'modality':<{width}}{'carrying':>9}" + "".join(f"{w:>12}" for w in places) + f"{'output/sample':>15}")
    for m in costs.modalities:
        cells = "".join(f"{(costs.forward[m][w] + costs.backward[m][w]) * 1e3:>12.3f}" for w in places)
        size = profile.places[places[0]].output_bytes.get(m, 0.0)
        rows.append(f"{m:<{width}}{carrying.get(m, 0.0):>9.2f}{cells}{size:>13.0f} B")
    rows.append(f"{'rest of the step':<{width}}{'':>9}" + "".join(f"{costs.backbone[w] * 1e3:>12.3f}" for w in places))
    rows.append("samples of a batch: " + ", ".join(f"{w} {n:g}" for w, n in samples.items()))
    rows.append("")
    rows.append("placement (the others split)        predicted step (encoders and the rest of the model)")
    ranked = ranked_placements(costs, samples, carrying, split_only=profile.split_only)
    split = predict_placement(costs, samples, carrying, {})
    for prediction in ranked[:shown]:
        name = ", ".join(f"{m}: {w}" for m, w in prediction.placement.items()) or "every encoder split"
        rows.append(f"{name:<36}{prediction.step_s * 1e3:>10.3f} ms  ({prediction.step_s / split.step_s:.2f}x split)")
    return "\n".join(rows)
