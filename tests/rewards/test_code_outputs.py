"""How the code reward compares a program's stdout with the expected output: decimals
within a pinned tolerance (abs or rel 1e-6), integers exact at any length, and Python's
4,300-digit int-to-str limit lifted inside the sandboxed harness."""

from __future__ import annotations

import decimal

import pytest

from posttrain.config.rewards import CodeReward
from posttrain.rewards.code_verifier import DEFAULT_TOLERANCE, outputs_match, score_code
from posttrain.rewards.protocol import ScoreItem
from posttrain.rewards.sandbox import BwrapSandbox, Limits

LIMITS = Limits(wall_s=10, cpu_s=5, memory_mb=256, max_procs=16)
# 2**20000 written out by hand-free means: Decimal has no int-to-str digit limit
BIG = str(decimal.Decimal(2**20000))


@pytest.fixture(scope="module")
def sandbox():
    return BwrapSandbox()


def _stdio(program, outputs):
    return ScoreItem(
        uid="s", response=program, metadata={"inputs": [""] * len(outputs), "outputs": outputs}
    )


def test_the_tolerance_is_pinned():
    assert DEFAULT_TOLERANCE == 1e-6
    assert CodeReward(name="c", type="code").float_tolerance == 1e-6


@pytest.mark.parametrize(
    ("got", "want", "ok"),
    [
        ("0.3333333333", "0.333333", True),  # |diff| 3.3e-7 <= 1e-6
        ("0.3333", "0.333333", False),  # |diff| 3.3e-5
        ("0.333334", "0.333333", True),  # 1e-6: on the bound
        ("0.333335", "0.333333", False),  # 2e-6
        ("1000000.5", "1000000.0", True),  # relative: 0.5 <= 1e-6 * 1e6
        ("1000002.5", "1000000.0", False),  # 2.5 > 1
        ("2", "2.000000", True),  # an integer may answer a decimal
        ("5e-1", "0.5", True),
        ("-0.0000001", "0.000000", True),
        ("1 0.5000001\n2", "1 0.5\n2", True),  # token by token, line by line
        ("1  0.5", "1 0.5", False),  # the spaces between tokens still match as text
        ("0.5\n", "0.5\n\n", True),  # trailing blank lines and spaces, as before
        ("42.0", "42", False),  # an expected integer is exact
        ("43", "42", False),
        ("nan", "0.5", False),
        ("inf", "1e308", False),
        ("1e999", "1e999", True),  # equal text
        ("1e999", "1e998", False),  # both overflow: not compared as numbers
        ("0,5", "0.5", False),
        ("x=0.5000001", "x=0.5", False),  # a token is the whole run of non-spaces
        (BIG, BIG, True),
        (BIG[:-1] + "7", BIG, False),  # 6,021-digit integers differ in the last digit
        (BIG + ".0", BIG + ".0", True),
    ],
)
def test_outputs_match(got, want, ok):
    assert outputs_match(got, want) is ok


def test_tolerance_zero_compares_text():
    assert outputs_match("0.3333333333", "0.333333", 0.0) is False
    assert outputs_match("0.333333", "0.333333", 0.0) is True


@pytest.mark.parametrize("bad", [-1e-6, float("nan"), float("inf")])
def test_a_bad_tolerance_is_refused(bad, sandbox):
    with pytest.raises(ValueError, match="float_tolerance"):
        score_code(_stdio("print(1)", ["1"]), sandbox, LIMITS, bad)


@pytest.mark.parametrize("bad", [-1e-6, float("nan"), float("inf")])
def test_the_recipe_refuses_a_bad_tolerance(bad):
    with pytest.raises(ValueError, match="float_tolerance"):
        CodeReward(name="c", type="code", float_tolerance=bad)


@pytest.mark.parametrize(
    ("program", "want"),
    [("print('0.3333333333')", 1.0), ("print(1/3)", 1.0), ("print('0.3333')", 0.0)],
)
def test_stdio_decimals_pass_within_the_tolerance(program, want, sandbox):
    assert score_code(_stdio(program, ["0.333333"]), sandbox, LIMITS)[0] == want


def test_stdio_program_printing_a_6021_digit_integer_passes(sandbox):
    assert len(BIG) == 6021
    score, details = score_code(_stdio("print(2**20000)", [BIG]), sandbox, LIMITS)
    assert score == 1.0, details
    assert score_code(_stdio("print(2**20000 + 1)", [BIG]), sandbox, LIMITS)[0] == 0.0


def test_expected_output_given_as_a_long_int(sandbox):
    # metadata built in Python may hold the int itself; str() of it would raise here
    assert score_code(_stdio("print(2**20000)", [2**20000]), sandbox, LIMITS)[0] == 1.0


def test_humaneval_tests_can_print_long_integers(sandbox):
    item = ScoreItem(
        uid="h",
        response="    return 2 ** n\n",
        metadata={
            "code_prefix": "def power(n):\n",
            "entry_point": "power",
            "test": "def check(candidate):\n    assert len(str(candidate(20000))) == 6021\n",
        },
    )
    score, details = score_code(item, sandbox, LIMITS)
    assert score == 1.0, details


def test_the_service_passes_the_recipe_tolerance():
    from fastapi.testclient import TestClient

    from posttrain.rewards.service import create_app

    meta = {"inputs": [""], "outputs": ["0.333333"]}
    item = {"uid": "u", "response": "print('0.3333333333')", "metadata": meta}
    for tolerance, want in [(None, 1.0), (0.0, 0.0), (1e-9, 0.0)]:
        spec = {"name": "t", "type": "code"}
        if tolerance is not None:
            spec["float_tolerance"] = tolerance
        app = TestClient(create_app([spec]))
        assert app.post("/score", json={"items": [item]}).json()["scores"][0]["reward"] == want


# Output that tries the tolerance: non-numbers, overflow and floods score 0, promptly.
HOSTILE_OUTPUTS = {
    "nan": "print('nan')",
    "inf": "print('inf')",
    "overflow": "print('1e999')",
    "hex_float": "print((0.5).hex())",
    "flood_of_numbers": "print(' '.join(['0.5'] * 100_000))",
    "flood_of_lines": "print('0.5\\n' * 100_000)",
    "long_decimal": "print('0.' + '5' * 60_000)",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_OUTPUTS))
def test_hostile_outputs_score_zero(name, sandbox):
    score, details = score_code(_stdio(HOSTILE_OUTPUTS[name], ["0.25"]), sandbox, LIMITS)
    assert score == 0.0, details
