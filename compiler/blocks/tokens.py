"""From a declared range in pixels and frames to the token ranges a block sees.

A user declares latent pixels (`spatial`), text tokens (`sequence`), batch and,
for video models, latent frames (`frames`). A transformer block never sees
pixels: it sees `[batch, tokens, channels]` where tokens = frames x (height /
patch) x (width / patch), text tokens, or both joined (Flux's rotary tables
cover text and image tokens). This module turns the declared range into
bounds for those roles, picks two small probe sizes inside the range, and
learns which dimension of which block input is which role by comparing the
block inputs of the two probes.

Roles of a block input dimension:

- `batch`, `tokens` (image/video tokens), `sequence` (text tokens), `frames`
  (latent frames after temporal patching: Wan 2.2 5B gives each frame its own
  timestep, so its modulation has a frames axis), `audio` (the audio tokens
  of a model that makes sound beside the video, LTX-2);
- `joint`: tokens + sequence;
- `sequence*<k>`, `joint*<k>`: k times the text tokens (alone, or after the
  image tokens), for models that join k text encoders' tokens (HiDream: T5,
  Llama and each block's own Llama layer, 3 x the prompt);
- `<role>+<n>`: a role plus a constant (e.g. 257 image-prompt tokens before
  the text);
- `rows:<role>`: the rows of a timestep that is either one for the whole
  sample or one per token (LTXV and LTX-2 give each token its own where an
  image guides frames): named `tokens` (or `audio`) from probes that send
  one per token, then renamed by the family (`rows_roles`), its bounds
  widened down to 1, so that one graph serves both forms;
- anything else that changes between the probes is *unknown*: that block
  structure runs eager, with the input named in the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..keys.shapes import AUDIO, ShapeRange

BATCH, TOKENS, SEQUENCE, JOINT, FRAMES = "batch", "tokens", "sequence", "joint", "frames"
ROWS = "rows:"  # prefix of a timestep's rows: `rows:tokens`, `rows:audio`
COUNTED = (BATCH, TOKENS, SEQUENCE, FRAMES, AUDIO)  # the counts a call has; the other roles are made from them
BASE_ROLES = (BATCH, TOKENS, SEQUENCE, JOINT, FRAMES, AUDIO)
TEXT_MULTIPLES = (2, 3, 4)
# Tried after the base roles when naming a dimension (a coincidence then names the simpler role).
MULTIPLE_ROLES = tuple(f"{base}*{k}" for k in TEXT_MULTIPLES for base in (SEQUENCE, JOINT))

RoleMap = Dict[str, Dict[int, str]]  # input path -> dim -> role


@dataclass(frozen=True)
class Dims:
    """The sizes of one call of the whole model, in the units a user declares."""

    batch: int
    height: int  # latent pixels
    width: int
    frames: int = 1  # latent frames (1 for images)
    text: int = 77  # text tokens
    audio: int = 0  # audio tokens (0: no audio stream)

    def describe(self) -> str:
        frames = f" x {self.frames} frames" if self.frames != 1 else ""
        audio = f", {self.audio} audio tokens" if self.audio else ""
        return f"batch {self.batch}, latent {self.height}x{self.width}{frames}, {self.text} text tokens{audio}"


@dataclass(frozen=True)
class Geometry:
    """How latent pixels and frames become tokens: one token per patch."""

    patch: int = 2  # latent pixels per token side (patch size x packing)
    patch_frames: int = 1
    video: bool = False
    default_frames: Tuple[int, int] = (1, 1)
    # The model pads image tokens and text tokens up to a multiple of this before its blocks
    # (Z-Image: 32), so blocks only ever see multiples of it.
    token_multiple: int = 1
    # Audio tokens per latent frame at the slowest frame rate served, for a model with an audio stream beside the
    # video (LTX-2); 0: none. The audio range follows the frames range with it.
    audio_per_frame: float = 0.0

    def padded(self, count: int) -> int:
        """A token count as the blocks see it, after the model's padding."""
        return count + (-count) % self.token_multiple

    def tokens(self, dims: Dims) -> int:
        return self.padded((dims.frames // self.patch_frames) * (dims.height // self.patch) * (dims.width // self.patch))

    def text(self, dims: Dims) -> int:
        return self.padded(dims.text)

    def frames(self, dims: Dims) -> int:
        """Latent frames as the blocks see them (after temporal patching)."""
        return max(1, dims.frames // self.patch_frames)

    def audio_range(self, shape_range: ShapeRange) -> Tuple[int, int]:
        """Audio tokens of the videos the frames range holds (one at the least)."""
        if shape_range.audio is not None:
            return tuple(shape_range.audio)
        return 1, max(2, math.ceil(self.frames_range(shape_range)[1] * self.audio_per_frame))

    def frames_range(self, shape_range: ShapeRange) -> Tuple[int, int]:
        if shape_range.frames is not None:
            return tuple(shape_range.frames)
        return self.default_frames if self.video else (1, 1)

    def token_range(self, shape_range: ShapeRange) -> Tuple[int, int]:
        low, high = shape_range.spatial
        f_low, f_high = self.frames_range(shape_range)
        side_low = max(1, math.ceil(low / self.patch))
        side_high = max(side_low, high // self.patch)
        frames_low = max(1, f_low // self.patch_frames)
        frames_high = max(frames_low, f_high // self.patch_frames)
        return self.padded(frames_low * side_low * side_low), self.padded(frames_high * side_high * side_high)

    def sequence_range(self, shape_range: ShapeRange) -> Tuple[int, int]:
        low, high = shape_range.sequence
        return self.padded(low), self.padded(high)

    def block_range(self, shape_range: ShapeRange) -> ShapeRange:
        """The declared range with the token bounds (and frames) filled in, text tokens as the blocks
        see them (padded): the key of a block graph."""
        frames = self.frames_range(shape_range) if self.video else shape_range.frames
        audio = self.audio_range(shape_range) if self.audio_per_frame else shape_range.audio
        return replace(shape_range, frames=frames, tokens=self.token_range(shape_range),
                       sequence=self.sequence_range(shape_range), audio=audio)


def role_values(counts: Dict[str, int]) -> Dict[str, int]:
    """Every role's size from the counted ones (a timestep's rows: one per token unless given)."""
    out = dict(counts)
    for role in (TOKENS, AUDIO):
        if role in counts:
            out.setdefault(ROWS + role, counts[role])
    out[JOINT] = counts[TOKENS] + counts[SEQUENCE]
    for k in TEXT_MULTIPLES:
        out[f"{SEQUENCE}*{k}"] = k * counts[SEQUENCE]
        out[f"{JOINT}*{k}"] = counts[TOKENS] + k * counts[SEQUENCE]
    return out


def counts_of(geometry: Geometry, dims: Dims) -> Dict[str, int]:
    return role_values({BATCH: dims.batch, TOKENS: geometry.tokens(dims), SEQUENCE: geometry.text(dims),
                        FRAMES: geometry.frames(dims), AUDIO: dims.audio})


def counted(counts: Dict[str, int]) -> Dict[str, int]:
    """The counts among `counts` that roles are made from (the role values of another call, read back), with
    a timestep's rows where they were set apart from the tokens."""
    return {k: counts[k] for k in counts if k in COUNTED or k.startswith(ROWS)}


def rows_roles(roles: RoleMap, inputs: Sequence[str]) -> RoleMap:
    """`roles` with dim 1 of each of `inputs` (a timestep per token, or one per sample) a timestep's rows."""
    out: RoleMap = {}
    for path, dims in roles.items():
        dims = dict(dims)
        if path in inputs and dims.get(1) in (TOKENS, AUDIO):
            dims[1] = ROWS + dims[1]
        out[path] = dims
    return out


_ROLE_WORDS = {BATCH: "the batch", TOKENS: "image tokens (the latent's, and any reference image's)",
               SEQUENCE: "text tokens", JOINT: "image and text tokens (a reference image's included)",
               FRAMES: "latent frames", AUDIO: "audio tokens (the soundtrack's latent, as long as the video)"}


def role_words(role: str) -> str:
    """What a role counts, in a user's words ("image and text tokens", "3 x text tokens + 257")."""
    if role.startswith(ROWS):
        return f"timestep rows (one, or one for each of the {role_words(role.removeprefix(ROWS))})"
    base, _, offset = role.partition("+")
    base, _, times = base.partition("*")
    words = (f"{times} x " if times else "") + _ROLE_WORDS.get(base, base)
    return words + (f" + {offset}" if offset else "")


def outside_range(paths: Sequence[str], shapes: Sequence[Sequence[int]], roles: RoleMap,
                  block_range: ShapeRange) -> Optional[Tuple[str, str]]:
    """(the base role, why) for the first input dimension outside the range's bounds for its role, or None."""
    for path, shape in zip(paths, shapes):
        for dim, role in roles.get(path, {}).items():
            low, high = role_bounds(role, block_range)
            size = int(shape[dim])
            if not low <= size <= high:
                side = f"more than the {high}" if size > high else f"fewer than the {low}"
                return (role.removeprefix(ROWS).partition("+")[0].partition("*")[0],
                        f"{path}.shape[{dim}] is {size}, {role_words(role)}: {side} its graph was built for")
    return None


def role_bounds(role: str, block_range: ShapeRange) -> Tuple[int, int]:
    """Inclusive bounds of a role (with its constant offset) in a block range."""
    if role.startswith(ROWS):
        return 1, role_bounds(role.removeprefix(ROWS), block_range)[1]
    base, _, offset = role.partition("+")
    extra = int(offset) if offset else 0
    base, _, times = base.partition("*")
    k = int(times) if times else 1
    if base == JOINT:
        t_low, t_high = block_range.bounds(TOKENS)
        s_low, s_high = block_range.bounds(SEQUENCE)
        low, high = t_low + k * s_low, t_high + k * s_high
    else:
        low, high = block_range.bounds(base)
        low, high = k * low, k * high
    return low + extra, high + extra


# -- probes -------------------------------------------------------------------

def _two(low: int, high: int, preferred: Iterable[int]) -> Tuple[int, int]:
    """Two different values inside [low, high], preferring the given ones (>= 2 avoids 0/1 special cases)."""
    picks: List[int] = []
    for value in list(preferred) + list(range(low, high + 1)):
        if low <= value <= high and value not in picks:
            picks.append(value)
        if len(picks) == 2:
            break
    if not picks:
        raise ValueError(f"empty range {low}-{high}")
    return picks[0], picks[-1]


def _frames_pair(low: int, high: int, batch: Tuple[int, int]) -> Tuple[int, int]:
    """Two frame counts that change unlike the batch where the range allows (a frames axis must not read as the
    batch), the first >= 2 where it can be."""
    first = _two(low, high, preferred=(max(low, 2),))[0]
    for second in [first + 2, first + 1] + list(range(low, high + 1)):
        if low <= second <= high and second != first and (first, second) != batch:
            return first, second
    return _two(low, high, preferred=(first,))


def _multiple_at_least(value: int, multiple: int) -> int:
    return max(multiple, value + (-value) % multiple)


def probe_dims(geometry: Geometry, shape_range: ShapeRange, spatial_multiple: int) -> Tuple[Dims, Dims]:
    """Two small calls inside the range whose roles all differ, so each block dimension can be named.

    Each role takes a different size in the two probes where the range allows
    it, and no two roles change the same way (else a dimension could not be
    told apart); sizes are kept >= 2, where tracing treats 0 and 1 specially.
    """
    b1, b2 = _two(*shape_range.batch, preferred=(2, 3))
    f_low, f_high = geometry.frames_range(shape_range)
    f1, f2 = _frames_pair(f_low, f_high, (b1, b2)) if geometry.video else (1, 1)
    s_low, s_high = shape_range.sequence
    audio = (list(_audio_candidates(*geometry.audio_range(shape_range))) if geometry.audio_per_frame
             else [(0, 0)])
    smallest = None
    for side, wider in _side_pairs(geometry, shape_range.spatial, spatial_multiple, f1, f2):
        smallest = smallest or (side, wider)
        first, second = Dims(b1, side, wider, f1, 0), Dims(b2, wider, wider, f2, 0)
        candidates = (_text_candidates(s_low, s_high) if geometry.token_multiple == 1
                      else _padded_text_candidates(geometry, s_low, s_high))
        for t1, t2 in candidates:
            for a1, a2 in audio:
                pair = (replace(first, text=t1, audio=a1), replace(second, text=t2, audio=a2))
                if _distinct(geometry, *pair):
                    return pair
    side, wider = smallest
    t1, t2 = _two(s_low, s_high, preferred=(7, 11))
    a1, a2 = audio[0]
    return Dims(b1, side, wider, f1, t1, a1), Dims(b2, wider, wider, f2, t2, a2)


def _side_pairs(geometry: Geometry, spatial: Tuple[int, int], multiple: int, f1: int,
                f2: int) -> Iterable[Tuple[int, int]]:
    """Latent sides of the probes (first: side x wider, second: wider x wider), the smallest first.

    Where the model pads tokens to a multiple, small sides would all pad to the
    same count and the token axis would look static: the sides then grow until
    the two probes' padded token counts differ. Larger pairs follow, for when
    the padded image tokens of the first change exactly as the padded text
    tokens can (a text range of 1-64 pads to 32 or 64 only: image tokens 32 and
    64 would make the two axes indistinguishable).
    """
    low, high = spatial
    side = _multiple_at_least(max(low, 2 * multiple), multiple)
    if side > high:
        side = _multiple_at_least(low, multiple)
    wider = side + multiple if side + multiple <= high else side
    if geometry.token_multiple == 1:
        yield side, wider
        return
    found = False
    for a in range(side, high + 1, multiple):
        for b in range(a + multiple, high + 1, multiple):
            small, large = Dims(1, a, b, f1), Dims(1, b, b, f2)
            if geometry.tokens(small) != geometry.tokens(large) and geometry.tokens(small) >= 2:
                found = True
                yield a, b
    if not found:
        yield side, wider


def _padded_text_candidates(geometry: Geometry, low: int, high: int) -> Iterable[Tuple[int, int]]:
    """Text token pairs that stay two different counts after the model pads them."""
    m = geometry.token_multiple
    sizes = [k * m for k in range(1, geometry.padded(high) // m + 1) if k * m >= low]
    for i, t1 in enumerate(sizes):
        for t2 in sizes[i + 1:]:
            yield t1, t2


def _text_candidates(low: int, high: int) -> Iterable[Tuple[int, int]]:
    for t1 in (7, 11, 13, 5, 17, 19, 23, 3):
        for t2 in (11, 13, 17, 19, 23, 29, 31, 9, 4):
            if t1 != t2 and low <= t1 <= high and low <= t2 <= high:
                yield t1, t2
    if low != high:
        yield low, high


def _audio_candidates(low: int, high: int) -> Iterable[Tuple[int, int]]:
    """Audio token pairs, small ones first (the first >= 2)."""
    for a1 in (5, 6, 9, 10, 14, 15):
        for a2 in (8, 12, 21, 22, 25, 26, 27):
            if a1 != a2 and low <= a1 <= high and low <= a2 <= high:
                yield a1, a2
    if low != high:
        yield max(low, 2), high


def _distinct(geometry: Geometry, first: Dims, second: Dims) -> bool:
    """No two changing roles change alike; the first probe (the one traced) has no size below 2."""
    a, b = counts_of(geometry, first), counts_of(geometry, second)
    pairs = [(a[r], b[r]) for r in BASE_ROLES if a[r] != b[r]]
    return len(set(pairs)) == len(pairs) and all(a[r] >= 2 for r in BASE_ROLES if a[r] != b[r])


# -- naming the dimensions of block inputs --------------------------------------

class UnknownDimension(Exception):
    """A block input dimension changes with the call in a way no role explains."""


def infer_roles(paths: Sequence[str], shapes_a: Sequence[Sequence[int]], shapes_b: Sequence[Sequence[int]],
                counts_a: Dict[str, int], counts_b: Dict[str, int]) -> RoleMap:
    """Name each dimension that differs between the two probes' block inputs.

    A dimension equal in both probes is static. One that differs is the role
    whose two sizes it equals, else a role plus a constant (`sequence+257`),
    tried in the order batch, tokens, sequence, joint, frames (exact only), then
    multiples of the text tokens (`sequence*3`, `joint*3`); else UnknownDimension.
    """
    counts_a = role_values(counted(counts_a))
    counts_b = role_values(counted(counts_b))
    roles: RoleMap = {}
    for path, shape_a, shape_b in zip(paths, shapes_a, shapes_b):
        if len(shape_a) != len(shape_b):
            raise UnknownDimension(f"input {path} has rank {len(shape_a)} in one call and {len(shape_b)} in another")
        dims: Dict[int, str] = {}
        for dim, (x, y) in enumerate(zip(shape_a, shape_b)):
            if x == y:
                continue
            role = _match(x, y, counts_a, counts_b)
            if role is None:
                raise UnknownDimension(
                    f"{path}.shape[{dim}] is {x} in one call and {y} in another, which is none of batch "
                    f"({counts_a[BATCH]}, {counts_b[BATCH]}), image tokens ({counts_a[TOKENS]}, {counts_b[TOKENS]}), "
                    f"text tokens ({counts_a[SEQUENCE]}, {counts_b[SEQUENCE]})"
                    + (f" or latent frames ({counts_a[FRAMES]}, {counts_b[FRAMES]})"
                       if counts_a.get(FRAMES, 1) != counts_b.get(FRAMES, 1) else "")
                    + (f" or audio tokens ({counts_a[AUDIO]}, {counts_b[AUDIO]})"
                       if counts_a.get(AUDIO, 0) != counts_b.get(AUDIO, 0) else "")
                )
            dims[dim] = role
        if dims:
            roles[path] = dims
    return roles


def _match(x: int, y: int, counts_a: Dict[str, int], counts_b: Dict[str, int]) -> Optional[str]:
    for role in BASE_ROLES:
        if role in counts_a and counts_a[role] == x and counts_b[role] == y:
            return role
    for role in (BATCH, TOKENS, SEQUENCE, JOINT):  # a few frames plus a constant is too easily a coincidence
        offset = x - counts_a[role]
        if offset > 0 and y - counts_b[role] == offset:
            return f"{role}+{offset}"
    for role in MULTIPLE_ROLES:
        offset = x - counts_a[role]
        if offset >= 0 and y - counts_b[role] == offset:
            return role if offset == 0 else f"{role}+{offset}"
    return None


def shapes_at(shapes: Sequence[Sequence[int]], paths: Sequence[str], roles: RoleMap,
              counts: Dict[str, int]) -> List[Tuple[int, ...]]:
    """The input shapes a block would see at other role sizes (for checking guards at range corners)."""
    out = []
    for shape, path in zip(shapes, paths):
        dims = roles.get(path, {})
        resized = []
        for dim, size in enumerate(shape):
            role = dims.get(dim)
            if role is None:
                resized.append(int(size))
                continue
            base, _, offset = role.partition("+")
            resized.append(counts[base] + (int(offset) if offset else 0))
        out.append(tuple(resized))
    return out
