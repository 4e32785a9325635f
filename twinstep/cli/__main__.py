from twinstep.cli.main import entry

entry()
