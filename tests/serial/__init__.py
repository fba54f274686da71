"""The serial tier: `make test` runs it last, its tests one at a time beside the K chooser's
(tests/serial/conftest.py's two lanes), because each module checks a deadline or a measured
time that a test beside it would stretch: a killed node noticed within its deadline, a
stream's largest gap while others are refused, passes held to an emulated profile's
milliseconds, the K chooser settling from pass times the services measure on themselves, the
real Qwen pair's memory and time."""
