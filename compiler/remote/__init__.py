"""Graph libraries for fleets: pull and push graphs from shared storage, checked before download.

- location: a remote library on any fsspec file system, in the graphs folder's layout; errors as RemoteError
- select: which graphs fit this machine and a model, from manifests alone
- signing: ed25519 signatures on manifests; builder keys on the trust list
- pull / push: the two directions; small result types, never half-written files
- warmup: worker start from $KEEPFAST_REMOTE_LIBRARY

See docs/fleet.md.
"""

from .location import REMOTE_OPTIONS_ENV, RemoteError, RemoteLibrary
from .pull import PullOutcome, PullResult, PullStatus, pull, pull_for
from .push import PushOutcome, PushResult, PushStatus, push
from .select import ModelSelector, NotAModel, fit_problems, selector_for_module, selector_for_path, structures_of
from .signing import PublicKey, SignatureCheck, SigningKeyError, generate_key, load_private_key
from .warmup import REMOTE_LIBRARY_ENV, remote_library_url, warm_up_from_env

__all__ = [
    "REMOTE_LIBRARY_ENV", "REMOTE_OPTIONS_ENV", "ModelSelector", "NotAModel", "PublicKey", "PullOutcome",
    "PullResult", "PullStatus", "PushOutcome", "PushResult", "PushStatus", "RemoteError", "RemoteLibrary",
    "SignatureCheck", "SigningKeyError", "fit_problems", "generate_key", "load_private_key", "pull", "pull_for",
    "push", "remote_library_url", "selector_for_module", "selector_for_path", "structures_of",
    "warm_up_from_env",
]
