from draftloop.cli import main

main()
