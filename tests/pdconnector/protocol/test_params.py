import re

import pytest
from pdconnector.protocol.params import (
    TRANSFER_ID_PATTERN,
    EngineRole,
    PrefillCoordinates,
    TransferMode,
    TransferParamsError,
    TransferRequest,
    mint_incarnation,
    mint_transfer_id,
    parse_transfer_params,
    prefill_leg_params,
    pull_decode_leg_params,
    push_decode_leg_params,
)

PREFILL = PrefillCoordinates(engine_id="demo-prefill-0", host="10.0.0.5", side_channel_port=5600, tp_size=2)


def test_minted_transfer_ids_are_unique_and_valid_on_the_wire():
    minted = {mint_transfer_id() for _ in range(1000)}
    assert len(minted) == 1000
    assert all(re.fullmatch(TRANSFER_ID_PATTERN, transfer_id) for transfer_id in minted)


@pytest.mark.parametrize("mode", list(TransferMode))
def test_the_prefill_leg_reads_back_as_a_prefill_role(mode):
    assert parse_transfer_params(prefill_leg_params(mode, "tx-1")) == TransferRequest(
        mode=mode, role=EngineRole.PREFILL, transfer_id="tx-1"
    )


def test_the_push_decode_leg_reads_back_with_the_prefill_coordinates():
    request = parse_transfer_params(push_decode_leg_params("tx-1", PREFILL))
    assert request == TransferRequest(
        mode=TransferMode.PUSH, role=EngineRole.DECODE, transfer_id="tx-1", remote=PREFILL
    )


def test_the_pull_decode_leg_reads_back_with_the_remote_blocks_per_group():
    returned_by_prefill = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3], [7]],
        "remote_engine_id": PREFILL.engine_id,
        "remote_host": PREFILL.host,
        "remote_port": PREFILL.side_channel_port,
        "tp_size": PREFILL.tp_size,
        "remote_request_id": "cmpl-abc-0-1234abcd",
    }
    request = parse_transfer_params(pull_decode_leg_params(returned_by_prefill, "tx-9"))
    assert request.mode is TransferMode.PULL
    assert request.role is EngineRole.DECODE
    assert request.transfer_id == "tx-9"
    assert request.remote == PREFILL
    assert request.remote_block_ids == ((1, 2, 3), (7,))


def test_a_pull_names_the_start_of_prefill_that_holds_its_blocks_and_older_answers_name_none():
    answer = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1]],
        "remote_engine_id": PREFILL.engine_id,
        "remote_host": PREFILL.host,
        "remote_port": PREFILL.side_channel_port,
        "tp_size": PREFILL.tp_size,
    }
    incarnation = mint_incarnation()
    with_start = parse_transfer_params(
        pull_decode_leg_params({**answer, "remote_incarnation": incarnation}, "tx")
    )
    assert with_start.remote is not None and with_start.remote.incarnation == incarnation
    without = parse_transfer_params(pull_decode_leg_params(answer, "tx"))
    assert without.remote is not None and without.remote.incarnation == ""
    assert mint_incarnation() != incarnation


def test_a_flat_block_list_from_older_upstream_prefills_is_one_group():
    params = {**push_decode_leg_params("tx-1", PREFILL), "transfer_mode": "pull", "remote_block_ids": [4, 5]}
    assert parse_transfer_params(params).remote_block_ids == ((4, 5),)


def test_upstream_parameters_without_a_mode_mean_pull():
    params = {**push_decode_leg_params("tx-1", PREFILL), "remote_block_ids": [[1]]}
    del params["transfer_mode"]
    assert parse_transfer_params(params).mode is TransferMode.PULL


def broken(key: str, value: object) -> dict[str, object]:
    params = dict(push_decode_leg_params("tx-1", PREFILL))
    if value is DELETE:
        del params[key]
    else:
        params[key] = value
    return params


DELETE = object()


@pytest.mark.parametrize(
    ("params", "key"),
    [
        (broken("transfer_id", DELETE), "transfer_id"),
        (broken("transfer_id", "tx 1; drop"), "transfer_id"),
        (broken("transfer_id", 17), "transfer_id"),
        (broken("transfer_mode", "teleport"), "transfer_mode"),
        (broken("do_remote_prefill", "yes"), "do_remote_prefill"),
        (broken("do_remote_decode", True), "do_remote_prefill"),  # both set
        (broken("do_remote_prefill", False), "do_remote_prefill"),  # neither set
        (broken("remote_engine_id", DELETE), "remote_engine_id"),
        (broken("remote_host", ""), "remote_host"),
        (broken("remote_port", True), "remote_port"),
        (broken("remote_port", 70000), "remote_port"),
        (broken("remote_port", "5600"), "remote_port"),
        (broken("tp_size", 0), "tp_size"),
        ({**broken("transfer_mode", "pull")}, "remote_block_ids"),
        ({**broken("transfer_mode", "pull"), "remote_block_ids": [[1, -2]]}, "remote_block_ids"),
        ({**broken("transfer_mode", "pull"), "remote_block_ids": [[1], 2]}, "remote_block_ids"),
        ({**broken("transfer_mode", "pull"), "remote_block_ids": "1,2"}, "remote_block_ids"),
        ({**broken("remote_incarnation", "0123456789abcdeZ")}, "remote_incarnation"),
        ({**broken("remote_incarnation", 7)}, "remote_incarnation"),
    ],
)
def test_unusable_parameters_raise_an_error_naming_the_key(params, key):
    with pytest.raises(TransferParamsError) as caught:
        parse_transfer_params(params)
    assert caught.value.key == key
    assert repr(key) in str(caught.value)


def test_parameters_that_are_not_an_object_are_refused():
    with pytest.raises(TransferParamsError) as caught:
        parse_transfer_params(["do_remote_prefill"])
    assert caught.value.key == "kv_transfer_params"
