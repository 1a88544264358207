"""Signed manifests: a builder's ed25519 key vouches for a graph, a team trusts the builder once.

`graphs push` signs each manifest it uploads: the signature covers the
manifest's JSON (every field but the signature itself, in a canonical form),
and the manifest names the package's sha256 and size, so it covers the
package too. A puller checks the signature against the public keys on its
trust list (`graphs trust-key`, an explicit act) before it downloads the
package, and the package against the manifest's sha256 after. A manifest
changed after signing, or a signature by a key nobody here trusts, is
refused with the reason.

The signature lives in the manifest (`"signed"`), not in a file beside it:
the manifest is the one object a push creates last and create-only, so a
manifest and its signature can never come from two different pushers. The
store's manifest reader ignores the field, so a remote library keeps the
graphs folder's layout. Keys are `cryptography`'s Ed25519.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Tuple

from ..settings import SIGNING_KEY
from ..store.atomic import write_bytes

SIGNED_FIELD = "signed"
KEY_PREFIX = "keepfast-ed25519"
ALGORITHM = "ed25519"
SIGNING_KEY_ENV = SIGNING_KEY.name


class SigningKeyError(ValueError):
    """A key file is unreadable or not a KeepFast ed25519 key; the message says which and why."""


def _crypto():
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise SigningKeyError("signing and checking graph signatures needs cryptography: "
                        "python -m pip install cryptography") from None
    return serialization, ed25519


@dataclass(frozen=True)
class PublicKey:
    """A builder's public key as users pass it around: one line, `keepfast-ed25519 <base64> <name>`."""

    raw: bytes
    name: str = ""

    @property
    def key_id(self) -> str:
        """A short fingerprint: how manifests and the trust list name the key."""
        return hashlib.sha256(self.raw).hexdigest()[:16]

    def line(self) -> str:
        return f"{KEY_PREFIX} {base64.b64encode(self.raw).decode()} {self.name}".rstrip()

    @classmethod
    def from_line(cls, text: str) -> "PublicKey":
        parts = text.strip().split(None, 2)
        if len(parts) < 2 or parts[0] != KEY_PREFIX:
            raise SigningKeyError(f"not a KeepFast public key (expected a line '{KEY_PREFIX} <base64> [name]')")
        try:
            raw = base64.b64decode(parts[1], validate=True)
        except ValueError:
            raise SigningKeyError("the public key's base64 is damaged") from None
        if len(raw) != 32:
            raise SigningKeyError(f"an ed25519 public key has 32 bytes, this one {len(raw)}")
        return cls(raw, parts[2] if len(parts) > 2 else "")

    @classmethod
    def read(cls, source: str) -> "PublicKey":
        """A public key from a `.pub` file, or the line itself."""
        text = source
        if not source.strip().startswith(KEY_PREFIX):
            try:
                text = Path(source).read_text()
            except OSError as error:
                raise SigningKeyError(f"cannot read public key {source}: {error.strerror or error}") from None
        return cls.from_line(text)


@dataclass(frozen=True)
class SignatureCheck:
    """What a manifest's signature says: who signed it, and the problem if it is not good here."""

    key_id: str = ""
    signer: str = ""
    problem: str = ""  # empty: signed by a key this machine trusts, and the signature matches
    unsigned: bool = False

    @property
    def ok(self) -> bool:
        return not self.problem


def generate_key(path: Path, name: str) -> PublicKey:
    """A new signing key: the private key at `path` (PEM, mode 0600), the public key at `path`.pub."""
    serialization, ed25519 = _crypto()
    path = Path(path)
    if path.exists():
        raise SigningKeyError(f"{path} exists; not overwriting a key (remove it first if you mean to)")
    private = ed25519.Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = PublicKey(private.public_key().public_bytes(serialization.Encoding.Raw,
                                                         serialization.PublicFormat.Raw), name)
    path.parent.mkdir(parents=True, exist_ok=True)
    old_mask = os.umask(0o077)
    try:
        write_bytes(path, pem)
    finally:
        os.umask(old_mask)
    os.chmod(path, 0o600)
    write_bytes(path.with_name(path.name + ".pub"), (public.line() + "\n").encode())
    return public


def load_private_key(path: Path) -> Tuple[Any, PublicKey]:
    """The private key at `path` and its public key (named as in the `.pub` beside it, if any)."""
    serialization, ed25519 = _crypto()
    path = Path(path)
    try:
        private = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as error:
        raise SigningKeyError(f"cannot read signing key {path}: {error.strerror or error}") from None
    except (ValueError, TypeError) as error:
        raise SigningKeyError(f"{path} is not an unencrypted PEM private key ({error})") from None
    if not isinstance(private, ed25519.Ed25519PrivateKey):
        raise SigningKeyError(f"{path} is not an ed25519 key (make one with: python -m compiler graphs keygen FILE)")
    raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    name = ""
    try:
        name = PublicKey.from_line(path.with_name(path.name + ".pub").read_text()).name
    except (OSError, SigningKeyError):
        pass
    return private, PublicKey(raw, name)


def signed_payload(manifest: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: the manifest without its signature, canonical JSON."""
    body = {key: value for key, value in manifest.items() if key != SIGNED_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(manifest: Mapping[str, Any], private: Any, public: PublicKey) -> Dict[str, Any]:
    """The manifest with a signature by `private` added."""
    signature = private.sign(signed_payload(manifest))
    out = {key: value for key, value in manifest.items() if key != SIGNED_FIELD}
    out[SIGNED_FIELD] = {"algorithm": ALGORITHM, "key_id": public.key_id, "signer": public.name,
                         "signature": base64.b64encode(signature).decode()}
    return out


def check(manifest: Mapping[str, Any], trusted_keys: Mapping[str, Mapping[str, Any]]) -> SignatureCheck:
    """Whether a trusted key signed exactly this manifest. `trusted_keys`: TrustList.keys()."""
    signed = manifest.get(SIGNED_FIELD)
    if signed is None:
        return SignatureCheck(problem="it is not signed", unsigned=True)
    if not isinstance(signed, dict) or signed.get("algorithm") != ALGORITHM:
        return SignatureCheck(problem="its signature is not an ed25519 signature of this format")
    key_id, signer = str(signed.get("key_id", "")), str(signed.get("signer", ""))
    entry = trusted_keys.get(key_id)
    if not isinstance(entry, Mapping):
        who = f"{signer!r} " if signer else ""
        return SignatureCheck(key_id, signer, problem=(
            f"it is signed by {who}key {key_id}, which this machine does not trust; if you trust that builder: "
            "python -m compiler graphs trust-key THEIR_KEY.pub"))
    try:
        public = PublicKey.from_line(str(entry.get("public_key", "")))
        if public.key_id != key_id:
            return SignatureCheck(key_id, signer, problem=f"the trust list's entry for key {key_id} is damaged")
        _, ed25519 = _crypto()
        signature = base64.b64decode(str(signed.get("signature", "")), validate=True)
        ed25519.Ed25519PublicKey.from_public_bytes(public.raw).verify(signature, signed_payload(manifest))
    except SigningKeyError as error:
        return SignatureCheck(key_id, signer, problem=str(error))
    except Exception:  # InvalidSignature, or a signature that is not even base64
        return SignatureCheck(key_id, signer, problem=(
            f"its signature by key {key_id} does not match its contents (changed after it was signed)"))
    return SignatureCheck(key_id, signer or str(entry.get("name", "")))
