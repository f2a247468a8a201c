"""`d9d verify DIR`: recomputes the SHA-256 of every stage output and the CRC-32 of every token shard under DIR;
a same-size corruption (which the size check on every run lets through) is reported with the file named."""

from flows_corpora import small_job

from d9d.flows.cli import main
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.data_prep import prepare_data


def _prepared(tmp_path, corpus_dir):
    config = JobConfig.model_validate(small_job(tmp_path, corpus_dir)).resolved(tmp_path)
    prepare_data(config.data_prep, config.data_prep_output)
    return config.data_prep_output


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20
    path.write_bytes(bytes(data))


def test_verify_passes_an_intact_output_and_names_a_same_size_corruption(tmp_path, corpus_dir, capsys):
    output = _prepared(tmp_path / "work", corpus_dir)
    assert main(["verify", str(tmp_path / "work")]) == 0
    intact = capsys.readouterr().out
    assert "data-prep output" in intact and "token shards, checksums match" in intact and "BAD" not in intact

    shard = sorted((output / "train").glob("*.d9dtok"))[0]
    tokenizer = output / "tokenizer.json"
    _flip(shard)
    _flip(tokenizer)
    assert main(["verify", str(output)]) == 1
    report = capsys.readouterr().out
    assert f"BAD  {tokenizer} sha256" in report and "rerun the data-prep stage" in report
    assert f"BAD  {shard} sha256" in report
    assert f"BAD  {shard}: checksum mismatch" in report


def test_verify_of_a_directory_without_outputs_says_so(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    assert "nothing to verify" in capsys.readouterr().err
