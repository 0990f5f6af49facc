"""Citation rewards (BioReasoner): ids a completion cites, checked against the row's valid ids.

    rewards:
      - {name: citation_grounding, args: {valid_key: valid_pmids}}  # valid id +1, invented id -2
      - {name: invented_citation, weight: 0, label: hallucinated}   # logs the hallucination rate
      # valid: the corpus's ids
      - {name: citation_grounding, args: {valid_key: null, valid_file: data/corpus_pmids.txt}}

PMID_PATTERN finds "PMID: 12345" (also PMID-, PMID#, PMID=, "PubMed ID", an id of 5 digits or more
on the next line) and lists after one label ("PMIDs: 12345, 67890 and 13579", across a line break),
so an invented id cannot hide behind a valid one; listed ids after the first need 5 digits or more,
as PMIDs cited today have, so a year or a dose after a citation is not one. Both register themselves
(rewards.lookup imports this module).
"""
from __future__ import annotations

import functools
import os
import re

from answers import find_all
from rewards import register

PMID_PATTERN = (r"(?:PMIDs?|PubMed[ \t]*IDs?)[ \t]*(?:[:#=\-][ \t]*)?(?:\n\s*(?=\d{5}))?"
                r"(\d+(?:[ \t]*(?:\n[ \t]*)?(?:[,;&]|\band\b)[ \t]*(?:\n[ \t]*)?"
                r"\d{5,}(?!\d|[.\-]\d))*)")  # each run of blanks matches one way: linear
CITATION_SEPARATOR = r"\s*(?:[,;&]|\band\b)\s*"  # between the ids of one match's list


def citation_grounding(completion: str, sample: dict, pattern: str = PMID_PATTERN,
                       valid_key: str | None = "valid_pmids", reward_valid: float = 1.0,
                       penalty_invalid: float = -2.0, normalize: bool = False, dedupe: bool = True,
                       no_citation: float = 0.0, ignore_case: bool = True,
                       valid_file: str | None = None) -> float | None:
    r"""BioReasoner's grounding score: reward_valid per cited id in sample[valid_key],
    penalty_invalid per invented one; None when the sample has no valid_key. valid_file: a text file
    of ids (whitespace-separated, e.g. one a line) valid for every row as well, such as the ids of
    the whole corpus the prompts draw from; with valid_key: null they are the only valid ones.

        score = sum over citations c of (reward_valid if c is valid else penalty_invalid)
        normalize: score / number of citations (so citing every valid id earns nothing extra)

    Citations are the first group of `pattern` (or the whole match) anywhere in the completion,
    think block included (an invented id is invented wherever it appears), split into ids at
    commas, semicolons, "&" and "and" (PMID_PATTERN catches such lists after one label, so an
    invented id cannot hide behind a valid one), compared as strings.
    dedupe counts each distinct id once, so repeating a valid id earns nothing. ignore_case also
    catches "pmid 123". A completion without citations scores no_citation.

    >>> s = {"valid_pmids": ["111", 222]}
    >>> (citation_grounding("PMID: 111, PMID:222, PMID 111", s),
    ...  citation_grounding("PMID: 111 and PMID: 999", s))
    (2.0, -1.0)
    >>> (citation_grounding("PMID: 111 and PMID: 999", s, normalize=True),
    ...  citation_grounding("no refs", s))
    (-0.5, 0.0)
    >>> v = {"valid_pmids": ["11111", "22222"]}
    >>> (citation_grounding("[PMIDs: 11111; 22222, 99999]", v),
    ...  citation_grounding("PMID: 11111, 30 patients", v))
    (0.0, 1.0)
    """
    found = _citations(completion, sample, pattern, valid_key, dedupe, ignore_case, valid_file)
    if found is None:
        return None
    cited, valid = found
    if not cited:
        return float(no_citation)
    score = sum(reward_valid if c in valid else penalty_invalid for c in cited)
    return score / len(cited) if normalize else float(score)


@functools.lru_cache(maxsize=8)
def _ids_in_file(path: str, stamp: tuple) -> frozenset[str]:
    with open(path, encoding="utf-8-sig") as f:  # -sig: drops a byte-order mark (Notepad, Excel)
        return frozenset(f.read().split())


def file_ids(path: str) -> frozenset[str]:
    """The ids in a valid_file, read once (again when the file changes)."""
    st = os.stat(path)
    return _ids_in_file(path, (st.st_mtime_ns, st.st_size))


def check_valid_file(valid_key: str | None = "valid_pmids", valid_file: str | None = None,
                     **_) -> None:
    """Before the run: a valid_file that reads, and some source of valid ids."""
    if valid_file is not None:
        try:
            if not file_ids(valid_file):
                raise ValueError(f"args.valid_file={valid_file} holds no ids")
        except OSError as e:
            raise ValueError(f"args.valid_file={valid_file}: {e.strerror or e}") from None
        except UnicodeDecodeError:  # a .gz, say
            raise ValueError(f"args.valid_file={valid_file}: not UTF-8 text "
                             "(ids separated by whitespace)") from None
    elif valid_key is None:
        raise ValueError("args.valid_key is null and there is no args.valid_file: "
                         "no id would be valid")


def _citations(completion: str, sample: dict, pattern: str, valid_key: str | None, dedupe: bool,
               ignore_case: bool, valid_file: str | None = None
               ) -> tuple[list[str], set[str]] | None:
    """(ids cited in the completion, those of them valid: in the sample's ids or valid_file's), or
    None when the sample has no valid_key and there is no valid_file."""
    valid = sample.get(valid_key) if valid_key is not None else None
    if valid is None and valid_file is None:
        return None
    if valid is not None and (isinstance(valid, (str, bytes))
                              or not isinstance(valid, (list, tuple, set, frozenset))):
        raise TypeError(f"sample[{valid_key!r}] must be a list of ids, not {type(valid).__name__}")
    own, corpus = ({str(v).strip() for v in valid or ()},
                   file_ids(valid_file) if valid_file is not None else frozenset())
    cited = [c for found in find_all(pattern, completion, re.I if ignore_case else 0)
             for c in re.split(CITATION_SEPARATOR, found.strip(), flags=re.I) if c]
    # row ids and file ids, looked up apart, never merged: a corpus copy per completion is slow
    return ((list(dict.fromkeys(cited)) if dedupe else cited),
            {c for c in cited if c in own or c in corpus})


def invented_citation(completion: str, sample: dict, pattern: str = PMID_PATTERN,
                      valid_key: str | None = "valid_pmids", ignore_case: bool = True,
                      valid_file: str | None = None) -> float | None:
    r"""1.0 when the completion cites at least one id that is not in sample[valid_key] (nor in
    valid_file, as citation_grounding reads them), else 0.0 (None without either). Its mean is
    BioReasoner's hallucination rate: list it with weight 0 and `label: hallucinated` to log it in
    training and report it in eval.py.

    >>> s = {"valid_pmids": ["111"]}
    >>> (invented_citation("PMID: 111", s), invented_citation("PMID: 111, PMID: 999", s),
    ...  invented_citation("none", s))
    (0.0, 1.0, 0.0)
    >>> invented_citation("PMIDs 111 and 99999 agree", s)
    1.0
    """
    found = _citations(completion, sample, pattern, valid_key, True, ignore_case, valid_file)
    if found is None:
        return None
    cited, valid = found
    return float(any(c not in valid for c in cited))


def citation_pass(completion: str, sample: dict, **args) -> float | None:
    r"""1.0 when the completion cites no invented id, else 0.0: BioReasoner's tribunal "pass", whose
    rate was one minus its hallucination rate in every report (41 of 69 passed, 28 hallucinated).
    List it with weight 0 and `label: pass` to report it. Takes invented_citation's args.

    >>> s = {"valid_pmids": ["111"]}
    >>> citation_pass("PMID: 111", s), citation_pass("PMID: 999", s)
    (1.0, 0.0)
    """
    invented = invented_citation(completion, sample, **args)
    return None if invented is None else 1.0 - invented


citation_grounding.check_args = invented_citation.check_args = check_valid_file
citation_pass.check_args = check_valid_file
register("citation_grounding", row_keys=("valid_key",))(citation_grounding)
register("invented_citation", row_keys=("valid_key",))(invented_citation)
register("citation_pass", row_keys=("valid_key",))(citation_pass)
