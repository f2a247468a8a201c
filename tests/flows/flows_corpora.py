"""Small real corpora and job configs shared by the d9d-flows tests (a plain module, so tests import it)."""

TEXTS = [
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles",
    "Und wenn du lange in einen Abgrund blickst, blickt der Abgrund auch in dich hinein. — Ünïcødé ✓",
    "All the world's a stage,\nAnd all the men and women merely players;",
    "They have their exits and their entrances,\nAnd one man in his time plays many parts",
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;",
]


def small_job(tmp_path, corpus, **data_prep):
    """A job config dict for a fast data-prep run over `corpus` (a tiny BPE, one worker)."""
    section = {
        "corpus": {"kind": "files", "paths": [str(corpus)]},
        "tokenizer": {"kind": "train_bpe", "vocab_size": 300, "min_frequency": 1},
        "validation_fraction": 0.2,
        "workers": 1,
        "chunk_bytes": 1024,
        "retry_delay_seconds": 0,
    }
    section.update(data_prep)
    return {"workdir": str(tmp_path / "run"), "data_prep": section}
