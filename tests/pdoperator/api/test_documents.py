"""load_documents reads YAML like kubectl does and turns every kind of garbage into a SpecError."""

from __future__ import annotations

import time

import pytest
from pdoperator.api import API_VERSION, SpecError, load_documents, parse_pdservice


def errors_of(source) -> list[str]:
    with pytest.raises(SpecError) as caught:
        load_documents(source)
    return [str(error) for error in caught.value.errors]


def test_multiple_documents_skip_empty_ones():
    text = "---\na: 1\n---\n---\n# only a comment\n---\nb: 2\n"
    assert load_documents(text) == [{"a": 1}, {"b": 2}]


def test_a_kubernetes_list_is_flattened():
    text = "apiVersion: v1\nkind: List\nitems:\n- kind: A\n- kind: B\n"
    assert load_documents(text) == [{"kind": "A"}, {"kind": "B"}]


def test_a_list_item_that_is_not_an_object_is_named():
    assert errors_of("kind: List\nitems: [1]\n") == [
        "document 1: items[0]: must be a mapping (a Kubernetes object), got a number"
    ]


def test_bytes_and_paths_are_read_as_utf8(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_bytes("\ufeffname: caf\u00e9\n".encode())
    assert load_documents(path) == [{"name": "caf\u00e9"}]
    assert load_documents(path.read_bytes()) == [{"name": "caf\u00e9"}]


def test_dates_stay_the_strings_they_were_written_as():
    assert load_documents("servedName: 2024-01-01\nat: 2024-01-01T10:00:00Z\n") == [
        {"servedName": "2024-01-01", "at": "2024-01-01T10:00:00Z"}
    ]


def test_a_syntax_error_names_line_and_column():
    (error,) = errors_of("spec:\n  mode: push\n   bad: indent\n")
    assert error.startswith("yaml: line 3, column 7: mapping values are not allowed")


def test_an_unclosed_flow_sequence_is_a_syntax_error():
    (error,) = errors_of("a: [1, 2\n")
    assert error.startswith("yaml: line 2, column 1: ")


def test_duplicate_keys_are_rejected_instead_of_silently_keeping_the_last():
    assert errors_of("spec:\n  mode: push\n  mode: pull\n") == [
        "yaml: line 3, column 3: duplicate key 'mode'"
    ]


def test_merge_keys_may_be_overridden():
    text = "base: &b {mode: push, x: 1}\nspec:\n  <<: *b\n  mode: pull\n"
    assert load_documents(text)[0]["spec"] == {"mode": "pull", "x": 1}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("just a string\n", "document 1: must be a mapping (a Kubernetes object), got a string"),
        ("- a\n- b\n", "document 1: must be a mapping (a Kubernetes object), got a list"),
        ("a: 1\n---\n42\n", "document 2: must be a mapping (a Kubernetes object), got a number"),
        ("true\n", "document 1: must be a mapping (a Kubernetes object), got a boolean"),
    ],
)
def test_documents_that_are_not_objects(text, expected):
    assert errors_of(text) == [expected]


def test_binary_input_is_not_utf8():
    assert errors_of(b"\x89PNG\r\n\x1a\n\x00\x00") == ["yaml: not UTF-8 text (byte 0: b'\\x89')"]


def test_control_characters_are_a_yaml_error():
    assert errors_of("a: \x00\n") == [
        "yaml: position 3: unacceptable character #x0000: control characters are not allowed"
    ]


def test_an_alias_cycle_is_refused():
    assert errors_of("a: &x [*x]\n") == ["document 1: a YAML alias refers to its own ancestor"]


def test_an_alias_bomb_is_refused_quickly():
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    started = time.monotonic()
    assert errors_of("\n".join(levels) + "\n") == [
        "document 1: expands to more than 1000000 nodes through YAML aliases"
    ]
    assert time.monotonic() - started < 5


def test_absurd_nesting_is_an_error_not_a_crash():
    (error,) = errors_of("a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert error.endswith(
        ("nested too deeply", "exceeded maximum nesting depth (while increasing flow level)")
    )


def test_deep_nesting_the_parser_allows_is_then_rejected_as_a_spec():
    text = (
        f"apiVersion: {API_VERSION}\nkind: PDService\nmetadata: {{name: x}}\nspec: {{model: "
        f"{'[' * 990}{']' * 990}}}\n"
    )
    (document,) = load_documents(text)
    with pytest.raises(SpecError) as caught:
        parse_pdservice(document)
    assert [str(error) for error in caught.value.errors] == ["spec: is nested too deeply"]


def test_a_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_documents(tmp_path / "absent.yaml")
