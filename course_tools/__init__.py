"""The course's tooling: the `infra-lab` command line and what it runs besides grading."""
