"""What `shared/` refuses, as one tree: every class is a ValueError, as the bare ValueErrors it replaces were.

So pydantic validators (which report a ValueError as a validation error) and callers that catch ValueError keep
working, and `except SharedError` catches whatever shared/ raises on purpose. Kinds are by what went wrong, not by
module. Four subtrees predate this module and stay where they are, re-parented here, so their importers are
unchanged: PayloadError (shared.tensors.codec, with the API's codes), TermsError (shared.terms), SetupError and
PrivacyError (shared.privacy.errors, each drawn there with its own subclasses).

* SharedError               the base: a value, configuration or message that shared/ refuses
  + ModelConfigError        a model cannot be built so: preset, head split, sizes, dropout, active heads, a tensor
                            not laid out per head, an ECG class the model does not predict
  + StudyRuleError          a study's or round's rules refuse it: participation picks, weightings (unknown, unusable
                            weights, a metric they need), learned heads without usage, statistics sent in the clear
    - TermsError            (shared.terms) a study's terms are not valid; `problems` lists them
    - PluginIdentityError   an installed plug-in has no identity to check: its distribution has no RECORD, an
                            empty or unreadable one, or lacks a file it lists (shared.plugins)
  + AggregationError        updates cannot be exchanged or combined: partition, exchange, weights, names, shapes,
                            sums, per-head usages
  + MetricsError            metrics inputs, reported numbers or pooled evaluation statistics are malformed,
                            inconsistent, of another model, or of too few records
  + FormatError             bytes or text are not in a form cardiofl reads or writes: base64, keys and share values
                            of a message, an upload's meta, a PEM key file, an export, a dtype safetensors lacks
  + PayloadError            (shared.tensors.codec) a tensor payload was refused; `code` names why (malformed_payload)
  + PrivacyInputError       the privacy code cannot work with these parameters or inputs: DP and accounting
                            settings, graph, threshold and fixed-point sizes, a seed, share, mask or ring vector
                            of the wrong size
    - SetupError            (shared.privacy.errors) a study's secure-aggregation settings cannot work; `field`
                            names the setting
  + PrivacyError            (shared.privacy.errors) a secure round failed: BelowThreshold,
                            ShareDecryptionFailed, ValueOutOfRange, ProtocolViolation

The base is named after its package, as CoordinatorError and AgentError are, so a traceback says which layer
refused; not CardioflError, since `cardiofl` is also the name of the package that composes the services.

PrivacyInputError is no PrivacyError on purpose: a site leaves a secure round on a PrivacyError
(site_agent/secure_round.py), whereas a seed or a ring vector of the wrong size is a bug that must surface.

PrivacyError is a SharedError, hence a ValueError, after checking every caller in the repository: the
coordinator's secure rounds catch (PrivacyError, ValueError) together, the site agent catches ProtocolViolation
and PrivacyError by name, the coordinator's aggregation catches Exception; no `except ValueError` lies on a path
a PrivacyError takes, and no pydantic validator calls code that raises one. It follows PayloadError's precedent:
what another party sent (a share, a message out of order, too few inputs) is refused as a value. A new
`except ValueError` around secure-round or accounting code now catches these too: catch narrower there.

This module imports nothing from the project (nor torch), so every module of shared/ may import it.
"""

from __future__ import annotations

__all__ = [
    "AggregationError",
    "FormatError",
    "MetricsError",
    "ModelConfigError",
    "PluginIdentityError",
    "PrivacyInputError",
    "SharedError",
    "StudyRuleError",
]


class SharedError(ValueError):
    """Base of what shared/ refuses: a value, configuration or message it cannot work with."""


class ModelConfigError(SharedError):
    """A model cannot be built so: preset, head split, sizes, dropout, active heads, or an ECG class it lacks."""


class StudyRuleError(SharedError):
    """A study's or round's rules refuse it: participation, weighting, learned-heads usage, what a round may send."""


class PluginIdentityError(StudyRuleError):
    """An installed plug-in has no identity: no RECORD, an empty or unreadable one, or a file it lists is missing."""


class AggregationError(SharedError):
    """Updates cannot be exchanged or combined: partition, exchange, weights, names, shapes, sums or usages differ."""


class MetricsError(SharedError):
    """Metrics or pooled evaluation statistics are malformed, inconsistent, of another model, or of too few records."""


class FormatError(SharedError):
    """Bytes or text are not in a form cardiofl reads or writes: base64, a key, a message's meta, a file, a dtype."""


class PrivacyInputError(SharedError):
    """The privacy code cannot work with these parameters or inputs (DP, graph, threshold, seed, share, vector)."""
