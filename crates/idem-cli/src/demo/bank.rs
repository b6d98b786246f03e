//! The demo's one-call commands: `idem demo account`, `debit` and `credit-message`.

use idem::{
    Consumed, Idem, InvalidInput, Key, MessageId, Operation, Outcome, Principal, Request, Scope,
    Subscriber,
};
use idem_conformance::Bank;
use serde_json::json;

use crate::commands::{connected, positive};
use crate::fail::{self, Fail};

pub(crate) async fn account<K: Bank>(url: &str, id: i64, balance: Option<i64>) -> Result<(), Fail> {
    let bank = connected::<K>(url).await?;
    let result = async {
        if let Some(balance) = balance {
            if balance < 0 {
                return Err(Fail::from(InvalidInput::new(
                    "balance",
                    "must not be negative",
                )));
            }
            bank.set_balance(id, balance).await?;
        }
        let balance = bank.find_balance(id).await?.ok_or_else(|| {
            Fail::new(
                fail::NO_ACCOUNT,
                format!("no account {id}: create it with --balance"),
            )
        })?;
        say!("{}", json!({ "account": id, "balance": balance }));
        Ok(())
    }
    .await;
    bank.close().await?;
    result
}

pub(crate) async fn debit<K: Bank>(
    url: &str,
    account: i64,
    key: &str,
    amount: i64,
    principal: Option<String>,
) -> Result<(), Fail> {
    let key = Key::new(key)?;
    positive(amount)?;
    let principal = Principal::new(principal.unwrap_or_else(|| format!("account-{account}")))?;
    let scope = Scope::new(principal, Operation::new("debit", 1)?);
    let bank = connected::<K>(url).await?;
    let idem = Idem::new(bank.backend().clone());
    let out = idem
        .execute(
            &scope,
            &key,
            &Request::new(json!({ "amount": amount })),
            |tx| K::debit(tx, account, amount),
        )
        .await;
    bank.close().await?;
    match out? {
        Outcome::Executed(b) => {
            say!("{}", json!(b));
            eprintln!("executed: debited {amount} from account {account} under key \"{key}\"");
        }
        Outcome::Replayed(b) => {
            say!("{}", json!(b));
            eprintln!(
                "replayed: the stored response of the earlier call with key \"{key}\"; nothing was debited now"
            );
        }
    }
    Ok(())
}

pub(crate) async fn credit_message<K: Bank>(
    url: &str,
    subscriber: &str,
    message_id: &str,
    account: i64,
    amount: i64,
) -> Result<(), Fail> {
    let subscriber = Subscriber::new(subscriber)?;
    let message_id = MessageId::new(message_id)?;
    positive(amount)?;
    let payload = Request::new(json!({ "account": account, "amount": amount }));
    let bank = connected::<K>(url).await?;
    let idem = Idem::new(bank.backend().clone());
    let out = idem
        .consume(&subscriber, &message_id, Some(&payload), |tx| {
            K::credit(tx, account, amount)
        })
        .await;
    bank.close().await?;
    match out? {
        Consumed::Applied(b) => {
            say!("{}", json!(b));
            eprintln!("applied: {subscriber} processed message {message_id}; acknowledge it now");
        }
        Consumed::Duplicate => {
            eprintln!(
                "duplicate: {subscriber} already processed message {message_id}; nothing changed, acknowledge it"
            );
        }
    }
    Ok(())
}
