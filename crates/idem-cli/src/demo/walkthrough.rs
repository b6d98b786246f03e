//! The walkthrough, step by step, checked against its expected figures.

use idem::{
    Consumed, Error, ErrorKind, Idem, Key, MessageId, Operation, Outcome, Principal, Request,
    Scope, Subscriber,
};
use idem_conformance::harness::namespace;
use idem_conformance::{Balance, Bank, BankError};
use serde_json::json;

use crate::commands::positive;
use crate::fail::{self, Fail};

fn diverged(step: u32, what: impl std::fmt::Display) -> Fail {
    Fail::new(
        1,
        format!("the walkthrough diverged from the expected figures at step {step}: {what}"),
    )
}

pub(crate) async fn run<K: Bank>(url: &str) -> Result<(), Fail> {
    let ns = namespace("demo");
    let bank = fail::connect_within(url, K::connect(url, Some(&ns))).await?;
    let result = async {
        bank.setup().await?;
        steps(&bank).await
    }
    .await;
    bank.close().await?;
    result
}

async fn steps<K: Bank>(bank: &K) -> Result<(), Fail> {
    say!(
        "idem demo on {} ({}), in a private namespace removed afterwards",
        K::ENGINE,
        bank.server_version().await?
    );
    let idem = Idem::new(bank.backend().clone());
    let scope = Scope::new(Principal::new("account-1")?, Operation::new("debit", 1)?);
    let debit = |key: &'static str, amount: i64| {
        let idem = &idem;
        let scope = &scope;
        async move {
            let key = Key::new(key)?;
            positive(amount)?;
            let request = Request::new(json!({ "amount": amount }));
            Ok::<_, Fail>(
                idem.execute(scope, &key, &request, |tx| K::debit(tx, 1, amount))
                    .await,
            )
        }
    };
    let show = |r: &Result<Outcome<Balance>, Error<BankError>>| match r {
        Ok(Outcome::Executed(b)) => format!("executed -> {}", json!(b)),
        Ok(Outcome::Replayed(b)) => format!("replayed -> {}", json!(b)),
        Err(e) => format!("rejected: {e}"),
    };

    bank.set_balance(1, 1000).await?;
    say!(
        "1. account 1 starts with balance {}",
        bank.balance(1).await?
    );

    let r = debit("checkout-42", 100).await?;
    say!("2. debit(1, \"checkout-42\", 100): {}", show(&r));
    if !matches!(r, Ok(Outcome::Executed(Balance { balance: 900 }))) {
        return Err(diverged(2, show(&r)));
    }

    let r = debit("checkout-42", 100).await?;
    say!("3. debit(1, \"checkout-42\", 100) again: {}", show(&r));
    let balance = bank.balance(1).await?;
    say!("   balance is {balance}: the retry did not debit twice");
    if !matches!(r, Ok(Outcome::Replayed(Balance { balance: 900 }))) || balance != 900 {
        return Err(diverged(3, show(&r)));
    }

    let r = debit("checkout-42", 101).await?;
    say!("4. debit(1, \"checkout-42\", 101): {}", show(&r));
    say!(
        "   (the key was already used with another amount: refused before any effect, with \
         Error::KeyReused; a server-side function would raise SQLSTATE 22023, invalid parameter value)"
    );
    if !matches!(r, Err(Error::KeyReused { .. })) {
        return Err(diverged(4, show(&r)));
    }

    let direct = bank
        .insert_record_directly(
            "account-1",
            "debit:v1",
            "checkout-42",
            r#"{"amount":100}"#,
            r#"{"balance":900}"#,
        )
        .await;
    match direct {
        Err(e) if e.kind() == ErrorKind::UniqueViolation => say!(
            "5. direct INSERT of the stored identity: refused by the primary key ({}, code {})",
            e.kind(),
            e.code().unwrap_or("none")
        ),
        other => return Err(diverged(5, format!("{other:?}"))),
    }

    let before = bank.count_records().await?;
    let r = debit("big-debit", 5000).await?;
    let after = bank.count_records().await?;
    say!(
        "6. debit(1, \"big-debit\", 5000): {}; records before {before}, after {after}: nothing stays",
        show(&r)
    );
    if !matches!(r, Err(Error::Effect(BankError::Insufficient))) || before != after {
        return Err(diverged(6, show(&r)));
    }

    let subscriber = Subscriber::new("balance-projection")?;
    let message = MessageId::new("00000000-0000-4000-8000-000000000001")?;
    let consume = || idem.consume(&subscriber, &message, None, |tx| K::credit(tx, 1, 50));
    match consume().await {
        Ok(Consumed::Applied(b)) if b.balance == 950 => {
            say!(
                "7. consume(balance-projection, {message}, credit 50): applied -> {}",
                json!(b)
            );
        }
        other => return Err(diverged(7, format!("{other:?}"))),
    }
    match consume().await {
        Ok(Consumed::Duplicate) => say!(
            "8. the same message again: duplicate, nothing changes; balance {}",
            bank.balance(1).await?
        ),
        other => return Err(diverged(8, format!("{other:?}"))),
    }

    let empty = Key::new("").map(drop).map_err(|e| e.to_string());
    let zero = positive(0).map_err(|e| e.to_string());
    say!("9. empty key: {}", empty.clone().err().unwrap_or_default());
    say!("   amount 0: {}", zero.clone().err().unwrap_or_default());
    if empty.is_ok() || zero.is_ok() || bank.balance(1).await? != 950 {
        return Err(diverged(9, "invalid input was accepted"));
    }
    say!("the walkthrough gave the expected figures: 900, 900, rejection, 950");
    Ok(())
}
